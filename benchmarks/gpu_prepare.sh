#!/usr/bin/env bash
# Builds .gpu/ on this machine for the device tool's `carry` (a GPU machine cannot reach the
# package index, and the working tree travels only up to 64 MiB):
#   .gpu/w  wheels of pure-Python packages the device image lacks (gguf, pydot, accelerate,
#           tabulate: gpu_suite.sh installs them with --no-deps)
#   .gpu/p  SmolLM2's GGUF file (98 MB) in 20 MB parts, with its SHA-256
# and adds /.gpu/ to .git/info/exclude, so it is carried, never committed. The tracked tree
# is about 42 MB of the 64 MiB a call may send, so one call carries one part; each stage of
# gpu_suite.sh first keeps the parts it was given in /tmp/gpu_parts, which lasts while the
# machine stays warm (30 s after a call: make the calls back to back). So:
#   run(carry=[".gpu/w", ".gpu/p/SHA256", ".gpu/p/part_aa"], command="bash benchmarks/gpu_suite.sh tests")
#   run(carry=[".gpu/w", ".gpu/p/part_ab"], command="bash benchmarks/gpu_suite.sh capture")
#   ... one part per call (kernels, decode, stash) ..., then the stages that read the model:
#   run(carry=[".gpu/w"], command="bash benchmarks/gpu_suite.sh smollm2")  # and sparse
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/w .gpu/p .git/info
python3 -m pip download -q --no-deps --disable-pip-version-check -d .gpu/w gguf pydot accelerate tabulate
gguf=$(python3 -c "from rewriter.gguf import smollm2_file; print(smollm2_file())")
rm -f .gpu/p/part_*
split -n "${PARTS:-2}" "$gguf" .gpu/p/part_
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") | awk '{print $1}' > .gpu/p/SHA256
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
du -sh .gpu/w .gpu/p
