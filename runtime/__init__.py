"""Runtime (KV cache, prefill/decode, generation, artifacts): not built yet."""
