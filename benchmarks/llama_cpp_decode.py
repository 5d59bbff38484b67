"""llama.cpp's greedy decode on a GGUF file, timed for ``decode.py --llama-cpp-python``.

Runs under the llama.cpp benchmark environment's Python (``benchmarks/llama_cpp_env.sh``),
which has ``llama-cpp-python`` and neither torch nor this project: it reads one JSON
request on stdin and writes one JSON answer on stdout.

    request: {"model": GGUF, "tokens": [prompt ids], "new": N, "threads": T, "repeat": R}
    answer:  {"seconds": [R timed runs], "tokens": [the N generated ids], "version": "..."}

A run is what ``decode.py`` times for the project: the prompt's prefill, then ``new``
greedy tokens one at a time, with no stop at the end of sequence; one warm-up run first.
"""
from __future__ import annotations

import json
import sys
import time


def check(request) -> dict:
    """The request, or ValueError naming what is wrong with it."""
    if not isinstance(request, dict):
        raise ValueError("the request must be a JSON object")
    for key in ("new", "threads", "repeat"):
        value = request.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key!r} must be a positive integer, got {value!r}")
    if not isinstance(request.get("model"), str):
        raise ValueError("'model' must be the GGUF file's path")
    tokens = request.get("tokens")
    if not isinstance(tokens, list) or not tokens or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise ValueError("'tokens' must be a non-empty list of token ids")
    return request


def main() -> None:
    request = check(json.load(sys.stdin))
    import llama_cpp
    tokens, new = request["tokens"], request["new"]
    llm = llama_cpp.Llama(model_path=request["model"], n_ctx=len(tokens) + new + 8,
                          n_threads=request["threads"], n_threads_batch=request["threads"],
                          verbose=False)

    def run() -> list[int]:
        llm.reset()
        llm.eval(tokens)
        made = []
        for _ in range(new):
            made.append(llm.sample(temp=0.0))  # temperature 0: the most likely token
            llm.eval([made[-1]])
        return made

    made = run()  # warm-up: allocates the context's buffers
    seconds = []
    for _ in range(request["repeat"]):
        start = time.perf_counter()
        made = run()
        seconds.append(time.perf_counter() - start)
    json.dump({"seconds": seconds, "tokens": made, "version": llama_cpp.__version__}, sys.stdout)


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        sys.exit(f"llama_cpp_decode.py: {e}")
