"""Reply chunks from the workers to OpenAI's response objects: whole responses and SSE chunks."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.base import protocol as p


def _chat_logprob(entry: p.TokenLogprob) -> dict:
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {**one(entry.token, entry.logprob), "top_logprobs": [one(t, lp) for _, t, lp in entry.top]}


def _completion_logprobs(entries: list[p.TokenLogprob], text_offset: int) -> dict:
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: lp for _, t, lp in e.top} for e in entries], "text_offset": offsets}


def usage_body(usage: p.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def timing_body(final: p.ReplyChunk) -> dict:
    """Our extension on the last object: where the time went, for clients and `bench serving`."""
    timing = final.timing.model_dump() if final.timing else {}
    return {**timing, "worker_id": final.worker_id, "model": final.model}


@dataclass
class Choice:
    text: str = ""
    logprobs: list[p.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class ResponseBuilder:
    """Builds one OpenAI object, whole or as chunks, for the chat or the completions endpoint."""

    kind: str  # "chat" or "completion"
    response_id: str
    created: int
    model: str
    include_usage: bool = False
    wants_logprobs: bool = False
    choices: dict[int, Choice] = field(default_factory=dict)

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def _envelope(self, obj: str) -> dict:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    # ---- whole response -------------------------------------------------------------------------------

    def add(self, chunk: p.ReplyChunk) -> None:
        choice = self.choices.setdefault(chunk.index, Choice())
        choice.text += chunk.text
        choice.logprobs.extend(chunk.logprobs or [])
        choice.finish_reason = chunk.finish_reason or choice.finish_reason

    def response(self, final: p.ReplyChunk, n: int) -> dict:
        body = self._envelope(self.object)
        body["choices"] = [self._whole_choice(i, self.choices.get(i, Choice())) for i in range(n)]
        body["usage"] = usage_body(final.usage)
        body["tokenfleet"] = timing_body(final)
        return body

    def _whole_choice(self, index: int, choice: Choice) -> dict:
        if self.kind == "chat":
            logprobs = {"content": [_chat_logprob(e) for e in choice.logprobs]} if self.wants_logprobs else None
            return {"index": index, "message": {"role": "assistant", "content": choice.text},
                    "logprobs": logprobs, "finish_reason": choice.finish_reason}
        logprobs = _completion_logprobs(choice.logprobs, 0) if self.wants_logprobs else None
        return {"index": index, "text": choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason}

    # ---- streaming ------------------------------------------------------------------------------------

    def chunk_object(self, choices: list[dict]) -> dict:
        body = self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = choices
        if self.include_usage:
            body["usage"] = None
        return body

    def role_chunks(self, n: int) -> list[dict]:
        if self.kind != "chat":
            return []
        return [self.chunk_object([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]) for i in range(n)]

    def delta_chunks(self, chunk: p.ReplyChunk) -> list[dict]:
        """A content chunk when there is text (or logprobs), then OpenAI's empty-delta chunk on finish."""
        choice = self.choices.setdefault(chunk.index, Choice())
        out = []
        if chunk.text or chunk.logprobs:
            out.append(self.chunk_object([self._stream_choice(chunk, choice)]))
        choice.text += chunk.text
        if chunk.finish_reason:
            finish = {"index": chunk.index, "logprobs": None, "finish_reason": chunk.finish_reason}
            finish.update({"delta": {}} if self.kind == "chat" else {"text": ""})
            out.append(self.chunk_object([finish]))
        return out

    def _stream_choice(self, chunk: p.ReplyChunk, choice: Choice) -> dict:
        if self.kind == "chat":
            logprobs = ({"content": [_chat_logprob(e) for e in chunk.logprobs or []]}
                        if self.wants_logprobs else None)
            return {"index": chunk.index, "delta": {"content": chunk.text}, "logprobs": logprobs,
                    "finish_reason": None}
        logprobs = _completion_logprobs(chunk.logprobs or [], len(choice.text)) if self.wants_logprobs else None
        return {"index": chunk.index, "text": chunk.text, "logprobs": logprobs, "finish_reason": None}

    def final_chunk(self, final: p.ReplyChunk) -> dict | None:
        """With include_usage, the usage chunk (`choices: []`), which also carries our timing; without it,
        nothing: OpenAI sends no chunk without choices then, and clients index `choices[0]`."""
        if not self.include_usage:
            return None
        body = self.chunk_object([])
        body["usage"] = usage_body(final.usage)
        body["tokenfleet"] = timing_body(final)
        return body
