#!/usr/bin/env bash
# The GPU work, in as few device calls as possible (each call is at most 10 minutes):
#
#   bash benchmarks/gpu_suite.sh stash      # only keep the GGUF parts this call carried
#   bash benchmarks/gpu_suite.sh tests      # GPU tests + the kernel tests on the GPU      (~3 min)
#   bash benchmarks/gpu_suite.sh kernels    # benchmarks/triton_kernels.py timing          (~3 min)
#   bash benchmarks/gpu_suite.sh decode     # benchmarks/decode.py --device cuda, 1B        (~6 min)
#   [STRATEGIES="medusa hydra"] [SLOT=280] [EAGLE_NODES="48 8 16"] \
#   bash benchmarks/gpu_suite.sh smollm2 [F] # speculative.py on SmolLM2's GGUF F, per strategy
#                                            # (default: the parts carried so far, gpu_prepare.sh);
#                                            # eagle: the shipped draft alone at each tree size,
#                                            # 8 nodes expanded a level (the CPU record's)
#   bash benchmarks/gpu_suite.sh sparse [F]  # sparse.py decode speed at 8k on F, both backends (~8 min)
#   [SLOT=520] [BUDGET=470] [EAGLE_INIT=smollm2 [EAGLE_SEED=12] EAGLE_LR=2e-4] [EAGLE_VOCAB=4096] \
#   bash benchmarks/gpu_suite.sh eagle [F]   # chat data + an EAGLE draft layer trained on it
#                                            # (rewriter train-eagle; EAGLE_INIT: going on from a draft
#                                            # file on new questions), the file back in two
#                                            # halves: cat eagle_part_a? > f; sha256sum f
#                                            # EAGLE_VOCAB=N: trained on draft_vocab=N's tokens
#                                            # alone, every chain start (not yet run on a GPU)
#   [INIT=smollm2] [PROMPTS=..] [ROWS=..] [QUESTIONS=..] [LR=..] [SEED=3] [BLOCKS=4] [SLOT=540] \
#   bash benchmarks/gpu_suite.sh heads [F]   # Hydra heads trained on the GPU on more data than a
#                                            # CPU makes in a session; its work dir stays in
#                                            # /tmp/heads_work: a call within 30 s resumes it
#
# Results and logs go to $OUT (the device tool's folder) or benchmarks/results/gpu. The
# device image brings its own torch and triton and has no network, so the project is
# installed without dependencies and without build isolation (nothing is downloaded);
# packages the image lacks (gguf, pydot, ...) come as wheels in .gpu/w when present
# (benchmarks/gpu_prepare.sh builds .gpu; name it in the run's carry).
set -uo pipefail
stage=${1:?usage: gpu_suite.sh stash|tests|gpu-tests|kernels|decode|smollm2 [GGUF]|sparse [GGUF]|heads [GGUF]|eagle [GGUF]}
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log="$out/$stage.log"

setup() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
  if ls .gpu/w/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/w/*.whl || return 1
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . || return 1
}
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

stash() {  # keep the GGUF parts this call carried (gpu_prepare.sh) for later calls
  mkdir -p /tmp/gpu_parts
  if ls .gpu/p/* >/dev/null 2>&1; then cp .gpu/p/* /tmp/gpu_parts/; fi
  echo "GGUF parts held: $(cd /tmp/gpu_parts && ls | tr '\n' ' ')"
}

smollm2() {  # the GGUF file: the argument, or the parts held in /tmp/gpu_parts
  if [ -n "${1:-}" ]; then printf '%s\n' "$1"; return; fi
  [ -f /tmp/gpu_parts/SHA256 ] || { echo "no GGUF file: give one, or carry its parts" >&2; return 1; }
  cat /tmp/gpu_parts/part_* > /tmp/smollm2.gguf
  [ "$(sha256sum /tmp/smollm2.gguf | awk '{print $1}')" = "$(cat /tmp/gpu_parts/SHA256)" ] \
    || { echo "the GGUF parts held do not add up to the file (SHA-256): carry the rest" >&2; return 1; }
  echo /tmp/smollm2.gguf
}

{
  stash
  setup || exit 1
  case "$stage" in
    stash) ;;
    tests)
      python3 -m pytest -q -p no:warnings -p no:logging --tb=short -m gpu tests
      python3 -m pytest -q -p no:warnings -p no:logging --tb=short tests/test_codegen_kernels.py ;;
    gpu-tests)
      python3 -m pytest -q -p no:warnings -p no:logging --tb=short -m gpu tests ;;
    kernels)
      python3 benchmarks/triton_kernels.py --json "$out/kernels.json" ;;
    decode)
      python3 benchmarks/decode.py --device cuda --model llama-1b --batch 1 --prompt 128 \
        --new 128 --repeat 3 --json "$out/decode.json" ;;
    smollm2)
      gguf=$(smollm2 "${2:-}") || exit 1
      # one process each: a failure costs one strategy. On 2026-11-24 none finished a row in
      # 135 s (optimize() runs 3-6 times a strategy): one or two strategies a call, SLOT=280
      for s in ${STRATEGIES:-medusa hydra lookup self}; do
        draft=(--heads smollm2)
        # eagle: the largest tree first (on the H200 48 nodes verify at 1.23 steps, 8 at 1.16);
        # SLOT may cut the last size, and finished rows are kept
        [ "$s" = eagle ] && draft=(--heads none --eagle smollm2 --eagle-nodes ${EAGLE_NODES:-48 8 16} --dynamic 8 --new 48)
        timeout ${SLOT:-135} python3 benchmarks/speculative.py --device cuda --backend torch --model "$gguf" \
          "${draft[@]}" --strategies $s --dtype bfloat16 --batch ${BATCHES:-1} \
          --samples ${SAMPLES:-3} --json "$out/spec_$s.json"
      done ;;
    sparse)
      gguf=$(smollm2 "${2:-}") || exit 1
      for backend in torch triton; do  # the CPU record's settings (docs/benchmarks.md, sparse caches)
        timeout 250 python3 benchmarks/sparse.py --model "$gguf" --device cuda --dtype bfloat16 \
          --backend $backend --lengths --ppl-chunks 0 --kv-length 8192 --batch 1 8 --new 32 \
          --windows 252 --sinks 4 --top-k 512 --selection-layers 2 8 14 20 --recent 128 256 \
          --quest-budget 768 --quest-dense-layers 2 --duo-gates smollm2 --duo-sinks 16 \
          --duo-window 240 --duo-sparsity 0.5 --json "$out/sparse_$backend.json"
      done ;;
    heads)
      gguf=$(smollm2 "${2:-}") || exit 1
      # the heads are data-starved (docs/history/benchmarks-notebook.md); on the GPU the data is minutes. Seed 3:
      # other self-asked questions than the shipped heads' (seeds 0, 1 and 2); the corpus's
      # prompts and rows are reshuffled subsets of the same sets. 4 blocks a head (Hydra++'s
      # depth; --init needs at least the start file's blocks)
      timeout ${SLOT:-540} python3 -m rewriter train-heads "$gguf" --arch hydra --data mixed \
        --prompts ${PROMPTS:-8192} --rows ${ROWS:-4096} --questions ${QUESTIONS:-16384} \
        --epochs 1 --lr ${LR:-1e-3} --batch 2048 --generate-batch 256 --seed ${SEED:-3} --device cuda \
        --blocks ${BLOCKS:-4} ${INIT:+--init "$INIT"} --out "$out/hydra_gpu.safetensors" --work-dir /tmp/heads_work
      rc=$?
      ls -la /tmp/heads_work
      exit $rc ;;
    eagle)
      gguf=$(smollm2 "${2:-}") || exit 1
      # chat data and the EAGLE layer in one call (rewriter train-eagle); the draft file
      # (bfloat16, 9 MB; 17 in float32) comes back in two halves with its SHA-256: $OUT
      # takes files up to 16 MiB
      [ "${EAGLE_VOCAB:-}" = 0 ] && EAGLE_VOCAB=  # 0: the whole vocabulary, as train-eagle's
      seed=${EAGLE_SEED:-11}  # going on from a draft: new questions (the shipped one's was 11)
      [ -n "${EAGLE_INIT:-}" ] && [ -z "${EAGLE_SEED:-}" ] && seed=12
      timeout ${SLOT:-520} python3 -m rewriter train-eagle "$gguf" --device cuda \
        --seconds ${BUDGET:-470} --out /tmp/eagle_gpu --save-dtype bfloat16 \
        ${EAGLE_INIT:+--init "$EAGLE_INIT"} --seed $seed --lr ${EAGLE_LR:-5e-4} --data /tmp/eagle_rows \
        ${EAGLE_VOCAB:+--train-vocab "$EAGLE_VOCAB" --positions 4096}
      rc=$?
      if [ -f /tmp/eagle_gpu/eagle.safetensors ]; then
        split -n 2 /tmp/eagle_gpu/eagle.safetensors "$out/eagle_part_"
        sha256sum /tmp/eagle_gpu/eagle.safetensors | awk '{print $1}' > "$out/eagle.sha256"
      fi
      # the run's rows (rewriter.training.eagle_data: a CPU's later runs train on them too), in 15 MB pieces:
      # cat rows_part_* > rows-SEED.safetensors; sha256sum it against rows.sha256
      for f in /tmp/eagle_rows/rows-*.safetensors; do
        [ -f "$f" ] || continue
        split -b 15M "$f" "$out/rows_part_"
        sha256sum "$f" | awk -v n="$(basename "$f")" '{print $1, n}' > "$out/rows.sha256"
      done
      cp /tmp/eagle_gpu/train_eagle.json "$out/" 2>/dev/null
      exit $rc ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
} 2>&1 | tee "$log"
