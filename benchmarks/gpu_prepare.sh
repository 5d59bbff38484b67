#!/usr/bin/env bash
# Builds .gpu/ on this machine for the device tool's `carry` (a GPU machine cannot reach the
# package index, and the working tree travels only up to 64 MiB):
#   .gpu/w  wheels of pure-Python packages the device image lacks (gguf, pydot, accelerate,
#           tabulate: gpu_suite.sh installs them with --no-deps)
#   .gpu/p  SmolLM2's GGUF file (98 MB) in PARTS (default 2) parts, with its SHA-256
# and adds /.gpu/ to .git/info/exclude, so it is carried, never committed. A call sends the
# tracked tree (~42 MB, ~15 MB after `gpu_slim.sh on`) plus what it carries, so each half
# travels in its own call with the slim tree; gpu_suite.sh keeps the parts it was given in
# /tmp/gpu_parts, which lasts while the machine stays warm (30 s after a call: make the calls
# back to back). The 2026-11-24 lease ran:
#   bash benchmarks/gpu_slim.sh on
#   run(carry=[".gpu/p/SHA256", ".gpu/p/part_aa"], command="bash benchmarks/gpu_suite.sh stash")
#   run(carry=[".gpu/w", ".gpu/p/part_ab"], command="bash benchmarks/gpu_suite.sh smollm2")
#   run(carry=[".gpu/w"], command="bash benchmarks/gpu_suite.sh sparse")
#   bash benchmarks/gpu_slim.sh off
#   run(carry=[".gpu/w"], command="bash benchmarks/gpu_suite.sh gpu-tests")
# Heads trained on the GPU (the SmolLM2 heads lack data; a CPU session makes ~0.5M positions)
# go after the two "stash"-style calls, while the parts are held:
#   run(carry=[".gpu/w"], command="INIT=smollm2 bash benchmarks/gpu_suite.sh heads")
# its heads file comes back in $OUT; time it on the CPU with speculative.py --heads FILE.
# Issue 13's EAGLE draft on a GPU (not yet run: a 48-node tree verifies there at 1.23 plain
# steps, 8 nodes at 1.16, so its speed-up may be a GPU's): the two calls above, the second as
#   run(carry=[".gpu/w", ".gpu/p/part_ab"], command="STRATEGIES=eagle SLOT=400 SAMPLES=8 bash benchmarks/gpu_suite.sh smollm2")
# then, with `gpu_slim.sh off`, the GPU tests (EAGLE's included):
#   run(carry=[".gpu/w"], command="bash benchmarks/gpu_suite.sh gpu-tests")
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/w .gpu/p .git/info
python3 -m pip download -q --no-deps --disable-pip-version-check -d .gpu/w gguf pydot accelerate tabulate
gguf=$(python3 -c "from rewriter.models.gguf import smollm2_file; print(smollm2_file())")
rm -f .gpu/p/part_*
split -n "${PARTS:-2}" "$gguf" .gpu/p/part_
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") | awk '{print $1}' > .gpu/p/SHA256
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
du -sh .gpu/w .gpu/p
