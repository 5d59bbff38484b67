"""One rank of the failure tests (``test_tp_run.py``): rank 1 fails, rank 0 waits for it
at a collective, and the launch must end by itself, with rank 1's error or gloo's timeout.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/tp_fail_worker.py MODE TIMEOUT

MODE ``raise``: rank 1 raises before the collective. ``stall``: rank 1 sleeps far past
TIMEOUT (alive, silent), so rank 0's collective times out. ``differ``: no rank fails, but
rank 1 brings other bytes to ``process_group.agree``, which every rank must refuse. Each rank says on stderr when
it raised or began to wait (``at <unix time>``), for the test to time the ending from.
"""
from __future__ import annotations

import sys
import time
import traceback

from rewriter.runtime import process_group as pg


def main(mode: str, timeout: float) -> None:
    rank, _ = pg.start(timeout)
    try:
        if rank == 1 and mode == "raise":
            print(f"raised at {time.time()}", file=sys.stderr, flush=True)
            raise RuntimeError("rank 1 fails on purpose")
        if rank == 1 and mode == "stall":
            time.sleep(20 * timeout)  # alive and silent: the launcher ends it
        print(f"waiting at {time.time()}", file=sys.stderr, flush=True)
        differs = rank == 1 and mode == "differ"
        pg.agree(b"other bytes" if differs else b"the same bytes", "test bytes")
    except Exception as e:
        pg.record_failure(f"{type(e).__name__}: {' '.join(str(e).split())}",
                          traceback.format_exc())
        raise
    finally:
        pg.stop()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
