"""Train draft heads (Medusa, or Hydra with ``--arch hydra``) and write them as a heads file.

    python examples/train_heads.py smollm2 --out heads.safetensors
    python examples/train_heads.py default --out heads.safetensors --prompts 256 --arch hydra

The same as ``rewriter train-heads MODEL --out PATH``. Interrupted runs resume from
``PATH.work/`` (cached data and a checkpoint). ``MedusaHeads(weights=PATH)`` or
``HydraHeads(weights=PATH)`` uses the result.
"""
from rewriter.cli import main

if __name__ == "__main__":
    import sys
    main(["train-heads", *sys.argv[1:]])
