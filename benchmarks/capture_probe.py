"""Why the Triton backend's decode step is not captured as a CUDA graph: a diagnosis to run
on a GPU (``bash benchmarks/gpu_suite.sh capture``, about a minute).

    python benchmarks/capture_probe.py [--json benchmarks/results/gpu/capture.json]

The H100 run of 2026-11-22 saw "operation not permitted when stream is capturing" at the
first Triton launch inside the capture, after an eager step had launched every kernel. So
the probe records, for every Triton launch: whether the stream was capturing, and whether
the launch compiled a new specialization (a compile or module load inside a capture is one
of the calls CUDA forbids there; a new specialization means some argument, an int equal
to 1 or a pointer's 16-byte alignment, differs between the eager step and the captured
one). It then tries the capture under each of CUDA's capture modes ("global" is
PyTorch's default; "thread_local" and "relaxed" allow calls another thread or this one
makes), keeps the first failure's full traceback, and checks the eager step for host
synchronisations (``torch.cuda.set_sync_debug_mode``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
import warnings

import torch


def _kernel_count(fn) -> int:
    """Specializations compiled so far by a ``triton.jit`` function, -1 if unknown."""
    try:
        return sum(len(entry[0]) for entry in fn.device_caches.values())
    except (AttributeError, TypeError, IndexError):
        return -1


@contextlib.contextmanager
def _recording(log: list):
    """Wrap ``JITFunction.run``: one record per launch."""
    from triton.runtime.jit import JITFunction
    original = JITFunction.run

    def run(self, *args, **kwargs):
        capturing = torch.cuda.is_current_stream_capturing()
        before = _kernel_count(self)
        record = dict(kernel=getattr(self, "__name__", str(self)), capturing=capturing)
        log.append(record)
        try:
            return original(self, *args, **kwargs)
        except Exception as e:
            record["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            raise
        finally:
            record["compiled"] = _kernel_count(self) - before if before >= 0 else None

    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = original


def _try_capture(engine, mode: str, log: list) -> dict:
    """One generation with the decode step captured under ``mode``."""
    import rewriter.runtime.generate as generate
    real_graph = torch.cuda.graph
    failure = {}

    def graph(cuda_graph, **kwargs):
        kwargs["capture_error_mode"] = mode
        return real_graph(cuda_graph, **kwargs)

    original_run = generate._run

    def run(*args, **kwargs):  # the step's own error, before the capture's end reports its own
        try:
            return original_run(*args, **kwargs)
        except Exception:
            if torch.cuda.is_current_stream_capturing() and "traceback" not in failure:
                failure["traceback"] = traceback.format_exc()
            raise

    generate.torch.cuda.graph = graph
    generate._run = run
    log.clear()
    engine.replays.clear()  # the engine keeps its replays: each mode captures its own
    try:
        with warnings.catch_warnings(record=True) as caught, _recording(log):
            warnings.simplefilter("always")
            engine.static_decode = None  # static steps + CUDA graph on CUDA
            out = engine.generate([[3, 17, 42, 5, 99, 8], [1, 2, 3]], max_new_tokens=8,
                                  eos_token_id=[])
        fell_back = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    except Exception as e:
        return dict(mode=mode, error=f"{type(e).__name__}: {e}", **failure)
    finally:
        generate.torch.cuda.graph = real_graph
        generate._run = original_run
    in_capture = [r for r in log if r["capturing"]]
    return dict(mode=mode, captured=not fell_back, warnings=fell_back, tokens=out.tolist(),
                step_error=failure.get("traceback"),
                launches=len(log), launches_in_capture=len(in_capture),
                compiled_in_capture=[r for r in in_capture if r.get("compiled")],
                errors_in_capture=[r for r in in_capture if "error" in r][:5])


def _sync_check(engine) -> str:
    """The first host synchronisation inside an eager static decode step, if any (the
    generation loop around the steps synchronises on purpose, so only steps are checked)."""
    from rewriter.runtime.replay import Replay
    original_init, original_call = Replay.__init__, Replay.__call__

    def init(self, run, inputs, cuda_graph, name="step"):  # static steps, no graph
        original_init(self, run, inputs, False, name)

    def call(self, *args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original_call(self, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    Replay.__init__, Replay.__call__ = init, call
    engine.replays.clear()  # made anew, without a graph
    engine.static_decode = True
    try:
        engine.generate([[3, 17, 42]], max_new_tokens=3, eos_token_id=[])
        return "none"
    except RuntimeError as e:
        return traceback.format_exc(limit=-8) if "synchroniz" in str(e) else f"other error: {e}"
    finally:
        Replay.__init__, Replay.__call__ = original_init, original_call


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the findings here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("capture_probe: needs a CUDA device (CUDA graphs); nothing to do on this machine")
        return 0
    import triton
    import rewriter
    from rewriter.checkpoints import load_hf_model
    from rewriter.passes import FuseAddRMSNorm, FuseQKV, FuseRoPE, FuseSwiGLU
    model = load_hf_model("default").cuda()  # the shipped 6.3M model
    engine = rewriter.optimize(model, passes=[FuseQKV(), FuseAddRMSNorm(), FuseSwiGLU(),
                                              FuseRoPE()], backend="triton")
    findings = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    triton=triton.__version__, captures=[])
    engine.static_decode = False
    eager = engine.generate([[3, 17, 42, 5, 99, 8], [1, 2, 3]], max_new_tokens=8,
                            eos_token_id=[]).tolist()
    log: list = []
    for mode in ("global", "thread_local", "relaxed"):
        result = _try_capture(engine, mode, log)
        result["same_tokens_as_eager"] = result.get("tokens") == eager
        findings["captures"].append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "tokens"}, indent=1))
    findings["host_sync_in_eager_step"] = _sync_check(engine)
    print("host sync in the eager step:", findings["host_sync_in_eager_step"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(findings, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
