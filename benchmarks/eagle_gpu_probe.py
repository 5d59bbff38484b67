"""A probe of the GPU paths `eagle_gpu.py` takes, on a random model, in seconds: sampled and
greedy generation through the runtime at two batch sizes, and the EAGLE layer trained and
scored on the device (`gpu_suite.sh eagle-probe`, run before the long call that needs them).

    python benchmarks/eagle_gpu_probe.py [cuda|cpu]
"""
import sys, time, types
import torch
from transformers import LlamaConfig, LlamaForCausalLM
sys.path.insert(0, "benchmarks")
import rewriter
from eagle_draft import Draft
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, eos_token_id=3, tie_word_embeddings=True)
model = LlamaForCausalLM(cfg).eval().to(dev)
t = time.perf_counter()
eng = rewriter.optimize(model)
print("optimize", round(time.perf_counter() - t, 1), "s", flush=True)
for b, n in ((64, 32), (256, 32)):
    t = time.perf_counter()
    out = eng.generate([[1, 5, 9]] * b, max_new_tokens=n, do_sample=True, temperature=1.0, top_k=50,
                       top_p=0.95, seed=1, eos_token_id=[3])
    g = eng.generate([[1, 5, 9, 7]] * b, max_new_tokens=n, eos_token_id=[])
    print("batch", b, "sampled+greedy", n, "tokens:", round(time.perf_counter() - t, 2), "s", tuple(out.shape), tuple(g.shape), flush=True)
N, L = 64, 40
data = {"tokens": torch.randint(0, 512, (N, L)), "start": torch.full((N,), 8), "end": torch.full((N,), L),
        "hidden": torch.randn(N, L, 64).to(torch.bfloat16)}
d = Draft(model, "random", 4, dev)
args = types.SimpleNamespace(steps=10**6, rows=8, positions=128, seed=0, lr=5e-4)
t = time.perf_counter()
loss = d.train(data, args, seconds=5.0, checkpoint=lambda s: None)
print("draft steps", args.steps_done, "in", round(time.perf_counter() - t, 1), "s; loss", round(loss, 3), flush=True)
print("accuracy", d.accuracy(data), flush=True)
d = Draft(model, "random", 4, dev)  # gpu_suite.sh eagle's EAGLE_VOCAB: a trimmed draft vocabulary
d.trim(torch.arange(0, 512, 2))
loss = d.train(data, args, seconds=3.0, checkpoint=lambda s: None)
print("trimmed draft steps", args.steps_done, "loss", round(loss, 3), "accuracy", d.accuracy(data), flush=True)
print("PROBE OK", flush=True)
