"""One rank of the tensor-parallel tests: launched by ``torch.distributed.run`` (two
processes, gloo on 127.0.0.1, see ``tp_tools.launch``), it builds each scenario's model
as the test process does, runs it split over the ranks, and writes what it got (greedy
tokens, the runtime's log-probabilities) to ``OUT/rank<r>.safetensors``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp_worker.py OUT s1 s2 ...
"""
from __future__ import annotations

import datetime
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # two ranks share the machine's cores


def main(out: str, names: list[str]) -> None:
    import tp_scenarios
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    results, calls = {}, _count_collectives()
    for name in names:
        calls.clear()
        try:
            results.update({f"{name}.{k}": v for k, v in tp_scenarios.run_split(name).items()})
        except tp_scenarios.REFUSED.get(name, ()) as error:
            # a refusal this scenario expects: recorded, and the ranks go on together (it
            # comes before any collective of the run, so no rank is left waiting)
            results[f"{name}.refused"] = _text(f"{type(error).__name__}: {error}")
        except Exception:  # any other error ends the launch; the tests' message names it
            print(f"rank {rank}: scenario {name!r} failed", file=sys.stderr, flush=True)
            raise
        results.update({f"{name}.calls.{op}": torch.tensor(n) for op, n in calls.items()})
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in results.items()},
              os.path.join(out, f"rank{rank}.safetensors"))
    dist.destroy_process_group()


def _text(message: str) -> torch.Tensor:
    return torch.tensor(list(message.encode()), dtype=torch.uint8)


def _count_collectives() -> Counter:
    """Count each functional collective the runtime calls (``runtime.collectives`` reads
    its ops through ``_C10D`` at every call), so tests see which form ran."""
    from rewriter.runtime import collectives
    calls, ops = Counter(), collectives._C10D

    class Counting:
        def __getattr__(self, name):
            op = getattr(ops, name)

            def call(*args, **kwargs):
                calls[name] += 1
                return op(*args, **kwargs)
            return call
    collectives._C10D = Counting()
    return calls


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
