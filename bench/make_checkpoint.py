"""Writes a random-weight HF Llama checkpoint of a named shape, with the built-in tokenizer, offline.

    python -m bench.make_checkpoint --shape llama3-8b --out /tmp/llama3-8b --device cuda
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, max_position_embeddings=8192, rope_theta=500000.0),
    "llama3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=8192, max_position_embeddings=8192, rope_theta=500000.0,
                        tie_word_embeddings=True),
}


def make(shape: str, out: Path, device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.text.builtin_models import build_tokenizer

    if (out / "config.json").is_file():
        return out
    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(make(args.shape, args.out, args.device))


if __name__ == "__main__":
    main()
