"""The checkpoint's own tokenizer and chat template, behind the few calls the engine, router and gateway make."""

from __future__ import annotations

import functools
import hashlib
import json

from services.text.errors import InvalidRequestError


class Tokenizer:
    def __init__(self, hf):
        """`hf`: a transformers fast tokenizer (from `tokenizer.json`, or built from a GGUF file's metadata)."""
        self.hf = hf

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.hf.eos_token_id
        return frozenset() if eos is None else frozenset([eos])

    @functools.cached_property
    def fingerprint(self) -> str:
        """Equal for two tokenizers that turn every prompt into the same ids: a hash of the vocabulary, merges,
        normalization and special-token rules (the backend's own serialization) and of the chat template. It
        keys the ids a request carries, so a hop uses only ids its own tokenizer would have given."""
        backend = json.loads(self.hf.backend_tokenizer.to_str())
        for setting in ("truncation", "padding"):  # per-call settings, not the tokenizer's
            backend.pop(setting, None)
        digest = hashlib.sha256(json.dumps(backend).encode())  # the backend writes its fields in a fixed order
        digest.update(json.dumps([self.hf.chat_template, self.hf.special_tokens_map], sort_keys=True,
                                 default=str).encode())
        return digest.hexdigest()[:32]

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for: a text of B bytes is at least B / this many tokens, which
        refuses a huge prompt without tokenizing it (4 MB took 3 s and 465 MB here)."""
        pieces = self.hf.batch_decode([[i] for i in range(len(self.hf))])
        return max(1, *(len(piece.encode()) for piece in pieces))

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        if self.hf.clean_up_tokenization_spaces:
            return self.hf.decode(token_ids, skip_special_tokens=True)
        # What transformers' decode returns without its clean-up, from the Rust tokenizer itself: a third of the
        # time (the detokenizer decodes twice per generated token, on the engine's step path).
        return self.hf.backend_tokenizer.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not self.hf.chat_template:
            raise InvalidRequestError("this model's tokenizer has no chat template", "messages")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        # The template already wrote any BOS it wants; encoding must not add another.
        return self.hf.encode(text, add_special_tokens=False)
