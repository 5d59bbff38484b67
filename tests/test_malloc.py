"""reuse_freed_memory: large blocks freed inside are reused without faulting pages in again,
and glibc's defaults come back on leaving."""
import platform
import resource

import pytest
import torch

from rewriter.malloc import reuse_freed_memory

def _huge_pages_always() -> bool:
    """Transparent huge pages on every mapping: a 64 MB block faults in 2 MB at a time, so
    counting faults cannot tell a fresh mapping from reused heap."""
    try:
        return "[always]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False


glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
                           or _huge_pages_always(), reason="glibc's mallopt, faults of 4 KB pages")
BLOCK = 64 << 20  # bytes: above glibc's largest mmap threshold (32 MB)


def faults_of_second_block() -> int:
    """Page faults of filling a 64 MB block right after one of that size was freed."""
    torch.empty(BLOCK, dtype=torch.uint8).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(BLOCK, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@glibc
def test_freed_blocks_are_reused_inside_and_unmapped_after():
    pages = BLOCK // resource.getpagesize()
    assert faults_of_second_block() > pages // 2        # glibc's default: mmap'd afresh
    with reuse_freed_memory():
        faults_of_second_block()                         # the heap grows once
        assert faults_of_second_block() < pages // 20   # then its pages are reused
    assert faults_of_second_block() > pages // 2        # defaults back


def test_an_error_inside_still_restores():
    with pytest.raises(RuntimeError, match="inside"):
        with reuse_freed_memory():
            raise RuntimeError("inside")
    if platform.libc_ver()[0] == "glibc" and not _huge_pages_always():
        assert faults_of_second_block() > BLOCK // resource.getpagesize() // 2
