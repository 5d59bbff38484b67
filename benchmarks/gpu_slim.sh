#!/usr/bin/env bash
# Makes room for SmolLM2's GGUF file in a device call: a call sends the tracked tree
# (~42 MB) plus what it carries, at most 64 MiB. `on` leaves the default model's weights and
# heads (~28 MB) out of the index and git-excludes them, so a call sends ~15 MB and can carry
# one 49 MB half of the file (gpu_prepare.sh); `off` puts them back. Nothing is deleted from
# disk, and nothing may be committed while it is on. The stages that read only SmolLM2
# (stash, smollm2, sparse) run with it on; the tests need it off.
set -euo pipefail
cd "$(dirname "$0")/.."
files=(rewriter/assets/default_model/model.safetensors rewriter/assets/heads/default-medusa.safetensors
       rewriter/assets/heads/default-hydra.safetensors)
case "${1:?usage: gpu_slim.sh on|off}" in
  on)
    git rm -q --cached "${files[@]}"
    for f in "${files[@]}"; do grep -qx "/$f" .git/info/exclude || echo "/$f" >> .git/info/exclude; done ;;
  off)
    git reset -q -- "${files[@]}"
    for f in "${files[@]}"; do grep -vx "/$f" .git/info/exclude > .git/info/exclude.new || true
      mv .git/info/exclude.new .git/info/exclude; done ;;
  *) echo "usage: gpu_slim.sh on|off" >&2; exit 2 ;;
esac
git ls-files -co --exclude-standard -z | xargs -0 cat | wc -c | awk '{printf "a call sends %.1f MB of the tree\n", $1 / 1e6}'
