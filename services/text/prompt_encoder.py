"""A request's prompt token ids exactly as its worker will compute them (the model's own tokenizer and chat
template), tokenized once per request and tokenizer: a hop that tokenizes attaches the ids to the request
(`GenerateRequest.prompt_token_ids`) and the hops after it read them. The gateway counts them against the
model's context, the router counts them for the tier rule and hashes them into KV blocks for the prefix
directory, the worker serves them."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future

from services.base import protocol as p
from services.text.errors import ModelLoadError
from services.text.tokenizer import Tokenizer
from services.text.tokenizer_files import open_tokenizer

log = logging.getLogger(__name__)


class PromptEncoder:
    def __init__(self, max_tokenizers: int = 8):
        self.max_tokenizers = max_tokenizers
        # model path -> its tokenizer's load, oldest use first. Requests are encoded in threads, several at once:
        # each load is shared, else each of a burst's first requests loaded its own copy of the tokenizer.
        self._loads: OrderedDict[str, Future[Tokenizer | None]] = OrderedDict()
        self._loads_lock = threading.Lock()

    def tokenizer(self, model_dir: str, wait: bool = True) -> Tokenizer | None:
        """None when this host has none for the model; with `wait` False, also while it is still loading (the load
        goes on in the background)."""
        with self._loads_lock:
            load = self._loads.get(model_dir)
            if load is None:
                load = self._loads[model_dir] = Future()
                threading.Thread(target=self._fill, args=(load, model_dir), name=f"tokenizer {model_dir}",
                                 daemon=True).start()
                if len(self._loads) > self.max_tokenizers:
                    self._loads.popitem(last=False)
            self._loads.move_to_end(model_dir)
        return load.result() if wait or load.done() else None

    def warm(self, model_dir: str) -> bool:
        """Loads the model's tokenizer now (a GGUF file's takes seconds to build), so that no request waits for
        it; False when this host has none."""
        return self.tokenizer(model_dir) is not None

    def _fill(self, load: Future, model_dir: str) -> None:
        try:
            load.set_result(self._load(model_dir))
        except Exception as exc:  # its waiters get the error, and the next request loads it again
            with self._loads_lock:
                if self._loads.get(model_dir) is load:
                    del self._loads[model_dir]
            load.set_exception(exc)

    @staticmethod
    def _load(model_dir: str) -> Tokenizer | None:
        try:
            tokenizer = open_tokenizer(model_dir)
        except (ModelLoadError, OSError):  # the model's files are not on this host: a later hop tokenizes
            log.warning("no tokenizer at %s: its requests are tokenized further on", model_dir)
            return None
        tokenizer.fingerprint  # noqa: B018 - computed here, in the background, rather than on a request's path
        return tokenizer

    def least_tokens(self, request: p.GenerateRequest, model_dir: str) -> int | None:
        """At least this many prompt tokens, told without tokenizing (None: no tokenizer on this host)."""
        if request.kind == "completion" and isinstance(request.prompt, list):
            return len(request.prompt)
        tokenizer = self.tokenizer(model_dir)
        if tokenizer is None:
            return None
        if request.kind == "completion":
            texts = [request.prompt or ""]
        else:  # the template adds to the messages' texts, never takes away
            contents = [m.get("content") or "" for m in request.messages or []]
            texts = [c if isinstance(c, str) else "".join(part.get("text") or "" for part in c) for c in contents]
        return sum(len(text.encode()) for text in texts) // tokenizer.longest_token_bytes

    def prompt_ids(self, request: p.GenerateRequest, model: str, model_dir: str,
                   wait: bool = True) -> list[int] | None:
        """The prompt's ids in the tokenizer of served model `model` (at `model_dir`): carried by the request, else
        tokenized here and attached to it. None when this host cannot tell (no tokenizer; with `wait` False, not
        loaded yet) or the tokenizer refuses the prompt (the worker's error will tell the client)."""
        carried = carried_ids(request, model)
        if carried is not None:
            return carried
        tokenizer = self.tokenizer(model_dir, wait)
        return None if tokenizer is None else _attach(request, model, tokenizer)

    async def prompt_ids_async(self, request: p.GenerateRequest, model: str, model_dir: str) -> list[int] | None:
        """`prompt_ids`, in a thread where it must tokenize."""
        carried = carried_ids(request, model)
        return carried if carried is not None else await asyncio.to_thread(self.prompt_ids, request, model,
                                                                           model_dir)


def carried_ids(request: p.GenerateRequest, model: str) -> list[int] | None:
    """The prompt's ids in served model `model`'s tokenizer, if the request has them: its prompt when that is ids,
    else what a hop attached."""
    if isinstance(request.prompt, list):
        return request.prompt
    carried = request.prompt_token_ids
    fingerprint = carried.tokenizers.get(model) if carried else None
    return None if fingerprint is None else carried.ids.get(fingerprint)


def ids_for(request: p.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt's ids in `tokenizer`: those the request carries for this very tokenizer, else tokenized now
    (raising what the tokenizer or its chat template raises)."""
    if isinstance(request.prompt, list):
        return request.prompt
    carried = request.prompt_token_ids
    ids = carried.ids.get(tokenizer.fingerprint) if carried else None
    return _tokenize(request, tokenizer) if ids is None else ids


def _attach(request: p.GenerateRequest, model: str, tokenizer: Tokenizer) -> list[int] | None:
    """Tokenizes once per tokenizer: models sharing one share the ids."""
    carried = request.prompt_token_ids or p.PromptTokenIds()
    ids = carried.ids.get(tokenizer.fingerprint)
    if ids is None:
        try:
            ids = _tokenize(request, tokenizer)
        except Exception:  # e.g. a template that rejects the roles (jinja2's TemplateError): the worker answers
            log.debug("cannot tokenize request %s here", request.request_id, exc_info=True)
            return None
        carried.ids[tokenizer.fingerprint] = ids
    carried.tokenizers[model] = tokenizer.fingerprint
    request.prompt_token_ids = carried
    return ids


def _tokenize(request: p.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    if request.kind == "chat":
        return tokenizer.apply_chat_template(request.messages or [])
    return tokenizer.encode(request.prompt or "")
