"""The checkpoint's own tokenizer and chat template, behind the few calls the engine and router make."""

from __future__ import annotations

from .errors import InvalidRequestError


class Tokenizer:
    def __init__(self, hf):
        """`hf`: a transformers fast tokenizer (from `tokenizer.json`, or built from a GGUF file's metadata)."""
        self.hf = hf

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.hf.eos_token_id
        return frozenset() if eos is None else frozenset([eos])

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not self.hf.chat_template:
            raise InvalidRequestError("this model's tokenizer has no chat template", "messages")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        # The template already wrote any BOS it wants; encoding must not add another.
        return self.hf.encode(text, add_special_tokens=False)
