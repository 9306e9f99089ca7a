"""Prompt sizes for the routing rule, from the small tier's `tokenizer.json` (the `tokenizers` library
alone: the router loads no model code). Chat counts the messages' text, not the template's few tokens."""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer

from services import protocol as p


@functools.lru_cache(maxsize=8)
def _tokenizer(model_dir: str) -> Tokenizer | None:
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def prompt_tokens(request: p.GenerateRequest, model_dir: str | None) -> int:
    tokenizer = _tokenizer(model_dir) if model_dir else None
    if request.kind == "completion" and isinstance(request.prompt, list):
        return len(request.prompt)
    texts = [request.prompt or ""] if request.kind == "completion" else [
        part for m in request.messages or [] for part in _texts(m.get("content"))]
    if tokenizer is None:  # no tokenizer at hand: ~4 characters a token
        return sum(len(t) for t in texts) // 4
    return sum(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False))


def _texts(content) -> list[str]:
    if isinstance(content, str):
        return [content]
    return [part.get("text", "") for part in content or [] if isinstance(part, dict)]
