"""Train Medusa draft heads for a model and write them as a heads file.

    python examples/train_heads.py --model smollm2 --out heads.safetensors
    python examples/train_heads.py --model default --out heads.safetensors --prompts 256

The same as ``rewriter train-heads MODEL --out PATH``. Interrupted runs resume from
``PATH.work/`` (cached data and a checkpoint). ``MedusaHeads(weights=PATH)`` uses the
result.
"""
from rewriter.cli import main

if __name__ == "__main__":
    import sys
    main(["train-heads", *sys.argv[1:]])
