"""Compile the kernels a run launches for a GPU that is not on this machine.

Without a GPU the Triton backend runs under ``TRITON_INTERPRET=1``, and the interpreter
accepts programs the GPU compiler rejects (it evaluates with numpy: no layout, register or
shared-memory limits, lenient about types). This module closes that gap on a CPU machine:

    with record_launches() as launches:       # under the interpreter
        opt.generate(ids, max_new_tokens=4)
    reports = compile_for(launches, arch=90)   # Triton + ptxas, in a clean subprocess

``record_launches`` notes each distinct specialization of each launched kernel (argument
types, alignment, constexpr values, options: what Triton's JIT would key its cache on), and
``compile_for`` compiles each to a cubin for ``sm_<arch>`` and reads its resource usage
(registers, spilled bytes, shared memory) with ``cuobjdump``. A kernel that would fail to
compile on the GPU fails here, with the compiler's message and the kernel's name.

The compile runs in a subprocess because the interpreter patches ``triton.language`` in the
process that used it, and the compiler cannot run on the patched module.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Iterator, Optional


@dataclass(frozen=True)
class Launch:
    """One kernel specialization: where its source lives and what the compiler is given."""
    module: str        # the defining module: imported by name when it is in a package
    file: str          # its source file: loaded by path otherwise (generated kernels)
    name: str          # the kernel function's name in that module
    signature: str     # JSON {param: type}, e.g. {"x_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    constexprs: str    # JSON [[path, value], ...]
    attrs: str         # JSON [[path, attributes], ...] (pointer alignment, ...)
    options: str       # JSON of launch options given at the call (num_warps, ...)


@dataclass
class CompileReport:
    name: str
    file: str
    signature: dict
    constexprs: dict
    ok: bool
    error: str = ""
    registers: Optional[int] = None
    stack_bytes: Optional[int] = None   # per-thread local memory: > 0 means spills or local arrays
    shared_bytes: Optional[int] = None
    num_warps: Optional[int] = None


# Shared memory one block may use (opt-in maximum, bytes): a kernel over it compiles but
# fails at launch with OutOfResources, so the report calls it a failure here.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


# Constexprs set only under the interpreter (see ``rewriter.codegen.interpreted``): the GPU
# build of the same launch gets these values. They must be passed by keyword.
GPU_CONSTEXPRS = {"DOT_F32": False}
_CHILD = "REWRITER_AOT_CHILD"  # set in the compile process: no recording, no nested compile


def _target(arch: int):
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", arch, 32)


@contextlib.contextmanager
def record_launches(arch: int = 90) -> Iterator[list[Launch]]:
    """Collects the specializations of every kernel launched inside the block (interpreter only).

    Each launch still runs, with the arguments the checked values came from; what is
    recorded is that launch as a GPU would compile it (``GPU_CONSTEXPRS`` applied). A
    specialization is listed once however often it is launched. Kernels must live in an
    importable module or file (not ``__main__``): the compile imports them elsewhere.
    """
    from triton.runtime import interpreter
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("record_launches needs TRITON_INTERPRET=1 (kernels run on the CPU)")
    if os.environ.get(_CHILD):
        raise RuntimeError("record_launches inside a kernel compile process (a kernel module "
                           "that launches kernels when imported?)")
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(_target(arch))
    binders: dict = {}
    launches: list[Launch] = []
    seen: set = set()
    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        if fn.__module__ == "__main__":
            raise RuntimeError(f"kernel {fn.__name__} is defined in __main__; the compile imports "
                               "kernels in another process: define it in a module")
        if fn not in binders:  # the decorator's options too (do_not_specialize, ...)
            jit = JITFunction(fn, **self.kwargs)
            binders[fn] = (jit, create_function_from_signature(jit.signature, jit.params, backend))
        jit, binder = binders[fn]
        gpu_kwargs = {**kwargs, **{k: v for k, v in GPU_CONSTEXPRS.items() if k in kwargs}}
        bound, spec, opts = binder(*args, **gpu_kwargs)
        options, signature, constexprs, attrs = jit._pack_args(backend, gpu_kwargs, bound, spec, opts)
        call_options = {k: v for k, v in kwargs.items() if k not in jit.arg_names}
        launch = Launch(module=fn.__module__, file=inspect.getsourcefile(fn), name=fn.__name__,
                        signature=json.dumps(signature),
                        constexprs=json.dumps([[list(k), _plain(v)] for k, v in constexprs.items()]),
                        attrs=json.dumps([[list(k), v] for k, v in attrs.items()]),
                        options=json.dumps(call_options, sort_keys=True))
        if launch not in seen:
            seen.add(launch)
            launches.append(launch)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run
    try:
        yield launches
    finally:
        interpreter.InterpretedFunction.run = original


def _plain(v):
    """A constexpr value as JSON (Triton dtypes by name)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return {"dtype": str(v)}


def compile_for(launches: list[Launch], arch: int = 90, timeout: float = 600) -> list[CompileReport]:
    """Compiles every launch for ``sm_<arch>`` in a clean subprocess; one report per launch.

    A kernel that does not compile gets a report with ``ok=False`` and the compiler's
    message; a compile process that dies or hangs raises, with its stderr."""
    if not launches:
        return []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[_CHILD] = "1"
    with tempfile.TemporaryDirectory(prefix="rewriter-aot-") as d:
        request, result = os.path.join(d, "request.json"), os.path.join(d, "result.json")
        with open(request, "w") as f:
            json.dump({"arch": arch, "launches": [asdict(x) for x in launches]}, f)
        # Its own process group, so a timeout ends everything it started.
        child = subprocess.Popen([sys.executable, "-m", "rewriter.codegen.aot", request, result],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True)
        try:
            _, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            _, stderr = child.communicate()
            raise RuntimeError(f"kernel compile took over {timeout:.0f} s; stderr:\n{stderr[-4000:]}")
        if child.returncode != 0 or not os.path.exists(result):
            raise RuntimeError(f"kernel compile process failed (exit {child.returncode}):\n"
                               f"{stderr[-4000:]}")
        with open(result) as f:
            return [CompileReport(**r) for r in json.load(f)]


# ---------------------------------------------------------------------------- in the subprocess

def _load_kernel(module: str, file: str, name: str):
    import importlib
    import importlib.util
    if "." in module:  # a template: its relative imports need its package
        return getattr(importlib.import_module(module), name)
    spec = importlib.util.spec_from_file_location(module, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def _value(v):
    if isinstance(v, dict) and "dtype" in v:
        import triton.language as tl
        return tl.dtype(v["dtype"])
    return v


def _compile_one(launch: dict, arch: int, modules: dict) -> dict:
    import triton
    from triton.compiler import ASTSource, make_backend

    signature = json.loads(launch["signature"])
    raw = {tuple(k): v for k, v in json.loads(launch["constexprs"])}
    named = {name: raw[(i,)] for i, name in enumerate(signature) if (i,) in raw}
    report = dict(name=launch["name"], file=launch["file"], signature=signature,
                  constexprs={k: repr(v) for k, v in named.items()}, ok=False)
    try:
        constexprs = {k: _value(v) for k, v in raw.items()}
        key = (launch["module"], launch["file"], launch["name"])
        if key not in modules:
            modules[key] = _load_kernel(*key)
        target = _target(arch)
        options = make_backend(target).parse_options(json.loads(launch["options"]))
        attrs = {tuple(k): v for k, v in json.loads(launch["attrs"])}
        kernel = triton.compile(ASTSource(modules[key], signature, constexprs, attrs),
                                target=target, options=options.__dict__)
    except Exception as e:  # the report carries the compiler's message
        report["error"] = f"{type(e).__name__}: {e}"[-3000:]
        return report
    # Triton's shared memory is dynamic, so it comes from its metadata, not the cubin.
    shared = kernel.metadata.shared
    report.update(ok=True, num_warps=kernel.metadata.num_warps, shared_bytes=shared,
                  **_resource_usage(kernel.asm["cubin"]))
    limit = SHARED_LIMIT.get(arch)
    if limit is not None and shared > limit:
        report.update(ok=False, error=f"needs {shared} bytes of shared memory; sm_{arch} has {limit}")
    return report


def _resource_usage(cubin: bytes) -> dict:
    """Registers and stack bytes of the cubin's one function, as cuobjdump reports them."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = {}
    for field, key in (("REG", "registers"), ("STACK", "stack_bytes")):
        m = re.search(rf"\b{field}:(\d+)", text)
        usage[key] = int(m.group(1)) if m else None
    return usage


def main(argv: list[str]) -> None:
    """``python -m rewriter.codegen.aot REQUEST.json RESULT.json``"""
    with open(argv[0]) as f:
        request = json.load(f)
    modules: dict = {}
    reports = [_compile_one(x, request["arch"], modules) for x in request["launches"]]
    with open(argv[1], "w") as f:
        json.dump(reports, f)


if __name__ == "__main__":
    main(sys.argv[1:])
