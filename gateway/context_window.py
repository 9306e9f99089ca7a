"""A prompt that cannot fit its model's context is refused before it is queued, counted exactly as its worker
will count it (the model's own tokenizer and chat template: `router.prompt_encoder`), off the event loop.
Refused here, it takes no queue slot, costs no worker time and writes no ledger row.

Most prompts are far shorter than the context: a token covers at least one UTF-8 byte, so a prompt whose bytes
(with an allowance for the chat template) fit is admitted uncounted, and a gateway loads a tokenizer (seconds,
100+ MB) only once a long prompt comes."""

from __future__ import annotations

import asyncio
import json

from gateway.schemas import RequestError
from gpu_worker.engine.errors import CONTEXT_LENGTH_EXCEEDED
from router.prompt_encoder import PromptEncoder
from services import protocol as p

# Tokens a chat template may add: per message (role markers), and once (a default system prompt, e.g. SmolLM2's).
TEMPLATE_TOKENS_PER_MESSAGE = 16
TEMPLATE_TOKENS = 256


class ContextWindow:
    def __init__(self, encoder: PromptEncoder | None = None):
        self.encoder = encoder or PromptEncoder()

    async def check(self, message: p.GenerateRequest, served: dict[str, p.ModelInfo]) -> None:
        """Raises `RequestError` (400 `context_length_exceeded`) when the prompt and its `max_tokens` fit none of
        the models the request may run on. A model whose tokenizer is not on this host is given the benefit of the
        doubt (its worker checks)."""
        longest = max(info.max_model_len for info in served.values())
        if _fits(_most_tokens(message), message.sampling.max_tokens, longest):
            return
        counts = await asyncio.to_thread(self._prompt_tokens, message, served)
        if any(n is None or _fits(n, message.sampling.max_tokens, info.max_model_len)
               for info, (n, _) in counts):
            return
        info, (n, exact) = max(counts, key=lambda pair: pair[0].max_model_len)
        raise RequestError(_refusal(message, info.max_model_len, n, exact))

    def _prompt_tokens(self, message: p.GenerateRequest,
                       served: dict[str, p.ModelInfo]) -> list[tuple[p.ModelInfo, tuple[int | None, bool]]]:
        """Per model: (its prompt tokens, exact), or (a lower bound, False) for a prompt surely too long to be
        worth tokenizing, or (None, True) when this host has no tokenizer for it."""
        counted: dict[str, tuple[int | None, bool]] = {}  # both tiers may serve one checkpoint: tokenized once
        for info in served.values():
            if info.model_dir in counted:
                continue
            least = self.encoder.least_tokens(message, info.model_dir)
            if least is not None and least > info.max_model_len:
                counted[info.model_dir] = (least, False)
                continue
            ids = self.encoder.prompt_ids(message, info.model_dir)
            counted[info.model_dir] = (None if ids is None else len(ids), True)
        return [(info, counted[info.model_dir]) for info in served.values()]


def _most_tokens(message: p.GenerateRequest) -> int:
    """At most this many prompt tokens, whatever the tokenizer: one per byte, and the template's allowance."""
    if isinstance(message.prompt, list):
        return len(message.prompt)
    if message.kind == "completion":
        return len((message.prompt or "").encode()) + 1  # + a BOS token
    messages = message.messages or []  # their JSON holds every text the template may render, and more
    return (TEMPLATE_TOKENS + TEMPLATE_TOKENS_PER_MESSAGE * len(messages)
            + len(json.dumps(messages, ensure_ascii=False).encode()))


def _fits(prompt_tokens: int, max_tokens: int | None, context: int) -> bool:
    """As the worker decides: the prompt leaves room for a token, and for all of `max_tokens` when set."""
    return prompt_tokens < context and (max_tokens is None or prompt_tokens + max_tokens <= context)


def _refusal(message: p.GenerateRequest, context: int, prompt_tokens: int, exact: bool) -> p.ErrorBody:
    """OpenAI's wording and code, `param` the part the client should shorten. `exact` False: `prompt_tokens` is
    a lower bound (the prompt was too long to be worth tokenizing)."""
    part = "messages" if message.kind == "chat" else "prompt"
    max_tokens = message.sampling.max_tokens
    if not exact:
        asked = f"your {part} resulted in more than {prompt_tokens} tokens"
    elif max_tokens is not None:
        asked = (f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {part}, {max_tokens} in "
                 "the completion)")
    else:
        asked = f"your {part} resulted in {prompt_tokens} tokens"
    return p.ErrorBody(message=f"This model's maximum context length is {context} tokens. However, {asked}. "
                               f"Please reduce the length of the {part} or completion.",
                       param=part, code=CONTEXT_LENGTH_EXCEEDED)
