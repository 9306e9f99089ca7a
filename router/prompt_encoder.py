"""A request's prompt token ids exactly as its worker will compute them (the model's own tokenizer and
chat template, through the engine's `Tokenizer`), so the router can hash the prompt's KV blocks and ask the
prefix directory who holds them, and count prompt tokens for the tier rule."""

from __future__ import annotations

import functools
import logging
import threading

from gpu_worker.engine.checkpoint import open_checkpoint
from gpu_worker.engine.errors import ModelLoadError
from gpu_worker.engine.tokenizer import Tokenizer
from services import protocol as p

log = logging.getLogger(__name__)


class PromptEncoder:
    def __init__(self, max_tokenizers: int = 8):
        self._cached = functools.lru_cache(maxsize=max_tokenizers)(self._load)
        # Requests are encoded in threads, several at once: without the lock each of a burst's first requests
        # loaded its own copy of the tokenizer (a router took 960 MB instead of 495).
        self._loading = threading.Lock()

    def _tokenizer(self, model_dir: str) -> Tokenizer | None:
        with self._loading:
            return self._cached(model_dir)

    def warm(self, model_dir: str) -> bool:
        """Loads the model's tokenizer now (a GGUF file's takes seconds to build), so that no request waits for
        it; False when this host has none."""
        return self._tokenizer(model_dir) is not None

    @staticmethod
    def _load(model_dir: str) -> Tokenizer | None:
        try:
            return open_checkpoint(model_dir).tokenizer()
        except (ModelLoadError, OSError):  # the model's files are not on this host: route by load alone
            log.warning("no tokenizer at %s: routing without prefix matching", model_dir)
            return None

    def least_tokens(self, request: p.GenerateRequest, model_dir: str) -> int | None:
        """At least this many prompt tokens, told without tokenizing (None: no tokenizer on this host)."""
        if request.kind == "completion" and isinstance(request.prompt, list):
            return len(request.prompt)
        tokenizer = self._tokenizer(model_dir)
        if tokenizer is None:
            return None
        if request.kind == "completion":
            texts = [request.prompt or ""]
        else:  # the template adds to the messages' texts, never takes away
            contents = [m.get("content") or "" for m in request.messages or []]
            texts = [c if isinstance(c, str) else "".join(part.get("text") or "" for part in c) for c in contents]
        return sum(len(text.encode()) for text in texts) // tokenizer.longest_token_bytes

    def prompt_ids(self, request: p.GenerateRequest, model_dir: str) -> list[int] | None:
        """None when this host cannot tell (no tokenizer) or the worker will reject the prompt anyway."""
        if request.kind == "completion" and isinstance(request.prompt, list):
            return request.prompt
        tokenizer = self._tokenizer(model_dir)
        if tokenizer is None:
            return None
        try:
            if request.kind == "chat":
                return tokenizer.apply_chat_template(request.messages or [])
            return tokenizer.encode(request.prompt or "")
        except Exception:  # e.g. a template that rejects the roles (jinja2's TemplateError): the worker answers
            log.debug("cannot encode request %s here", request.request_id, exc_info=True)
            return None
