"""Models from disk (Hugging Face checkpoints, GGUF files, the shipped default model) and the default model's corpus."""
