"""``benchmarks/llama_cpp_decode.py``, which ``decode.py --llama-cpp-python`` runs in the
llama.cpp benchmark's own venv: a bad request is refused by name, before llama.cpp loads
(this environment has no ``llama-cpp-python``, so reaching the import would fail otherwise)."""
from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "llama_cpp_decode.py"
GOOD = {"model": "m.gguf", "tokens": [1, 2, 3], "new": 4, "threads": 2, "repeat": 1}
check = runpy.run_path(str(SCRIPT), run_name="llama_cpp_decode")["check"]


@pytest.mark.parametrize("change, named", [
    ({"new": 0}, "'new'"),
    ({"threads": True}, "'threads'"),
    ({"repeat": "3"}, "'repeat'"),
    ({"model": None}, "'model'"),
    ({"tokens": []}, "'tokens'"),
    ({"tokens": [1, -2]}, "'tokens'"),
    ({"tokens": [1.5]}, "'tokens'"),
])
def test_a_bad_request_is_refused_by_name(change, named):
    with pytest.raises(ValueError, match=named):
        check({**GOOD, **change})
    assert check(dict(GOOD)) == GOOD


def test_the_script_refuses_in_one_line_before_loading_llama_cpp():
    done = subprocess.run([sys.executable, str(SCRIPT)], input=json.dumps([GOOD]),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "JSON object" in done.stderr and "Traceback" not in done.stderr
