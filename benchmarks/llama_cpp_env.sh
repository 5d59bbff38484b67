#!/usr/bin/env bash
# Makes the llama.cpp benchmark's own environment: a venv holding llama-cpp-python (built
# from source: a few minutes on 2 cores) and nothing of this project, so the project's
# dependencies stay free of it. Then:
#
#   bash benchmarks/llama_cpp_env.sh [DIR]              # default DIR: .venv-llama-cpp
#   python benchmarks/decode.py --model smollm2 --batch 1 --llama-cpp-python DIR/bin/python
#
# decode.py runs benchmarks/llama_cpp_decode.py under that Python, on the same GGUF file,
# prompt, number of new tokens and threads as its own runs.
set -euo pipefail
dir=${1:-.venv-llama-cpp}
python3 -m venv "$dir"
# LLAMA_CPP_VERSION=X.Y.Z pins the version a recorded figure was measured with
"$dir/bin/python" -m pip install -q "llama-cpp-python${LLAMA_CPP_VERSION:+==$LLAMA_CPP_VERSION}"
"$dir/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'in $dir')"
