"""The built-in checkpoints' weights, written deterministically on first use and cached on disk. Their names,
shapes, place and tokenizer are the text layer's (`services/text/builtin_models.py`), which needs no torch."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from services.text.builtin_models import (
    BUILTIN_MODELS,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_tokenizer,
    builtin_path,
    is_built,
)


def ensure_builtin(name: str) -> Path:
    target = builtin_path(name)
    if is_built(name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        _build(name, staging)
        try:
            staging.rename(target)  # atomic: concurrent builders race, one wins, the others discard
        except OSError:
            if not is_built(name):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build(name: str, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer()
    special = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)
    model_type, shape = BUILTIN_MODELS[name]
    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB_SIZE, max_position_embeddings=2048, rms_norm_eps=1e-5,
        bos_token_id=special[0], eos_token_id=[special[3], special[1]], pad_token_id=special[1], **shape,
    )
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
