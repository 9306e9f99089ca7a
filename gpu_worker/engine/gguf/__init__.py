"""GGUF checkpoints: reading llama.cpp's single-file format (metadata, tokenizer, quantized weights)."""
