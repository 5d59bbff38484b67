"""reuse_freed_memory: large blocks freed inside are reused without faulting pages in again,
and glibc's defaults come back on leaving.

The checks run in a fresh interpreter, in its main thread: page faults are counted for the
whole process, and a test process carries other tests' threads, heap and settings (an
xdist worker failed the check that way); glibc serves threads other than the main one from
arenas whose heaps are at most 64 MB, which map such blocks afresh whatever the settings;
and allocator variables in the environment (a preloaded allocator, glibc tunables) are
left out of the child's."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest


def _huge_pages_always() -> bool:
    """Transparent huge pages on every mapping: a 64 MB block faults in 2 MB at a time, so
    counting faults cannot tell a fresh mapping from reused heap."""
    try:
        return "[always]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False


glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
                           or _huge_pages_always(), reason="glibc's mallopt, faults of 4 KB pages")

PRELUDE = '''
import resource, torch
from rewriter.training.malloc import reuse_freed_memory
BLOCK = 64 << 20  # bytes: above glibc's largest mmap threshold (32 MB)
PAGES = BLOCK // resource.getpagesize()

def faults_of_second_block():
    """Page faults of filling a 64 MB block right after one of that size was freed."""
    torch.empty(BLOCK, dtype=torch.uint8).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(BLOCK, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
'''


ROOT = Path(__file__).resolve().parent.parent


def run_main_thread(body: str) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@glibc
def test_freed_blocks_are_reused_inside_and_unmapped_after():
    run_main_thread('''
assert faults_of_second_block() > PAGES // 2        # glibc's default: mmap'd afresh
with reuse_freed_memory():
    faults_of_second_block()                         # the heap grows once
    got = faults_of_second_block()
    assert got < PAGES // 20, got                    # then its pages are reused
assert faults_of_second_block() > PAGES // 2        # defaults back
''')


def test_an_error_inside_still_restores():
    from rewriter.training.malloc import reuse_freed_memory
    with pytest.raises(RuntimeError, match="inside"):
        with reuse_freed_memory():
            raise RuntimeError("inside")
    if platform.libc_ver()[0] == "glibc" and not _huge_pages_always():
        run_main_thread('''
try:
    with reuse_freed_memory():
        raise RuntimeError("inside")
except RuntimeError:
    pass
assert faults_of_second_block() > PAGES // 2
''')
