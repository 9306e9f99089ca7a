"""The prompt tokenized once, on its way in: admission tokenizes it (off the event loop) with the tokenizer of
each model the request may run on, as its worker will (`services.text.prompt_encoder`), and the ids travel in the
request for the router and the worker. A prompt that cannot fit its model's context is refused with those exact
counts before it is queued: it takes no queue slot, costs no worker time and writes no ledger row.

Most prompts are far shorter than the context: a token covers at least one UTF-8 byte, so a prompt whose bytes
(with an allowance for the chat template) fit is admitted without waiting for a tokenizer still loading (seconds,
100+ MB: it loads in the background, and the router tokenizes meanwhile)."""

from __future__ import annotations

import asyncio
import json

from services.base import protocol as p
from services.openai_api.schemas import RequestError
from services.text.errors import CONTEXT_LENGTH_EXCEEDED
from services.text.prompt_encoder import PromptEncoder

# Tokens a chat template may add: per message (role markers), and once (a default system prompt, e.g. SmolLM2's).
TEMPLATE_TOKENS_PER_MESSAGE = 16
TEMPLATE_TOKENS = 256


class ContextWindow:
    def __init__(self, encoder: PromptEncoder | None = None):
        self.encoder = encoder or PromptEncoder()

    async def check(self, message: p.GenerateRequest, served: dict[str, p.ModelInfo]) -> None:
        """Attaches the prompt's ids to `message` for the models whose tokenizer this host has, and raises
        `RequestError` (400 `context_length_exceeded`) when the prompt and its `max_tokens` fit none of the models
        the request may run on. A model whose tokenizer is not on this host is given the benefit of the doubt (its
        worker checks)."""
        longest = max(info.max_model_len for info in served.values())
        surely_fits = _fits(_most_tokens(message), message.sampling.max_tokens, longest)
        if surely_fits and isinstance(message.prompt, list):  # ids already: nothing to tokenize
            return
        counts = await asyncio.to_thread(self._prompt_tokens, message, served, not surely_fits)
        if surely_fits or any(n is None or _fits(n, message.sampling.max_tokens, info.max_model_len)
                              for info, (n, _) in counts):
            return
        info, (n, exact) = max(counts, key=lambda pair: pair[0].max_model_len)
        raise RequestError(_refusal(message, info.max_model_len, n, exact))

    def _prompt_tokens(self, message: p.GenerateRequest, served: dict[str, p.ModelInfo],
                       count_all: bool) -> list[tuple[p.ModelInfo, tuple[int | None, bool]]]:
        """Per model: (its prompt tokens, exact), or (a lower bound, False) for a prompt surely too long to be
        worth tokenizing, or (None, True) when this host has no tokenizer for it. `count_all` False: the prompt
        surely fits, and models whose tokenizer is still loading are left uncounted (None) rather than waited for."""
        counted = []
        for name, info in served.items():
            least = self.encoder.least_tokens(message, info.model_dir) if count_all else None
            if least is not None and least > info.max_model_len:
                counted.append((info, (least, False)))
                continue
            ids = self.encoder.prompt_ids(message, name, info.model_dir, wait=count_all)
            counted.append((info, (None if ids is None else len(ids), True)))
        return counted


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
