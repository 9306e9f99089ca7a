"""Between the stream protocol and the engine: a `GenerateRequest` to prompt ids and `SamplingParams`,
engine deltas to `ReplyChunk`s, and a reply stream's history back to the samples to resume."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_worker.engine import CompletionOutput, InvalidRequestError, LLMEngine, ResumedChoice, SamplingParams
from services.base import protocol as p
from services.text.errors import CONTEXT_LENGTH_EXCEEDED
from services.text.prompt_encoder import ids_for


def prompt_ids(engine: LLMEngine, request: p.GenerateRequest) -> list[int]:
    """The ids an earlier hop tokenized with this engine's very tokenizer, else tokenized here (checked alike)."""
    return engine.encode_prompt(ids_for(request, engine.tokenizer))


def sampling_params(engine: LLMEngine, request: p.GenerateRequest, num_prompt_tokens: int,
                    default_max_tokens: int | None = None) -> SamplingParams:
    """A request that sets no max_tokens gets `default_max_tokens`, or the rest of the context (OpenAI's rule)."""
    options = request.sampling.model_dump()
    room = engine.max_model_len - num_prompt_tokens
    if options["max_tokens"] is None:
        options["max_tokens"] = min(room, default_max_tokens or room)
    elif options["max_tokens"] > room:
        raise InvalidRequestError(
            f"this model's context is {engine.max_model_len} tokens; the prompt has {num_prompt_tokens} and "
            f"max_tokens asks for {options['max_tokens']} more", "max_tokens", CONTEXT_LENGTH_EXCEEDED)
    return SamplingParams(**options)


def logprob_entries(engine: LLMEngine, delta: CompletionOutput, top_n: int) -> list[p.TokenLogprob] | None:
    if delta.logprobs is None:
        return None
    decode = engine.tokenizer.decode
    entries = []
    for token_id, by_token in zip(delta.token_ids, delta.logprobs, strict=True):
        top = sorted(by_token.items(), key=lambda kv: -kv[1])[:top_n]
        entries.append(p.TokenLogprob(token_id=token_id, token=decode([token_id]), logprob=by_token[token_id],
                                      top=[(t, decode([t]), lp) for t, lp in top]))
    return entries


@dataclass
class ChoiceHistory:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


@dataclass
class ReplyHistory:
    """What a reply stream already holds: the tokens each sample published, whether it is over."""

    started: p.ReplyChunk | None = None
    choices: dict[int, ChoiceHistory] = field(default_factory=dict)
    closed: bool = False  # "finished" or "error" was published
    first_delta_at: float | None = None  # seconds since the epoch (a stream entry id is its time in ms)

    @classmethod
    def of(cls, entries: list[tuple[str, p.ReplyChunk]]) -> ReplyHistory:
        history = cls()
        for entry_id, chunk in entries:
            if chunk.kind == "started":
                history.started = history.started or chunk
            elif chunk.kind in ("finished", "error"):
                history.closed = True
            else:
                history._add_delta(entry_id, chunk)
        return history

    def _add_delta(self, entry_id: str, chunk: p.ReplyChunk) -> None:
        choice = self.choices.setdefault(chunk.index, ChoiceHistory())
        if chunk.position != len(choice.token_ids):
            return  # a repeat
        choice.token_ids.extend(chunk.token_ids)
        choice.text += chunk.text
        choice.finish_reason = chunk.finish_reason
        if self.first_delta_at is None and chunk.token_ids:
            self.first_delta_at = int(entry_id.split("-")[0]) / 1000

    def resume(self, n: int) -> list[ResumedChoice] | None:
        """None when nothing was produced yet (start afresh, sharing the prompt across samples)."""
        if not any(c.token_ids for c in self.choices.values()):
            return None
        return [ResumedChoice(i, c.token_ids, len(c.text))
                for i in range(n) if (c := self.choices.get(i, ChoiceHistory())).finish_reason is None]

    def completion(self, model: str, usage: p.Usage, max_tokens: int | None) -> p.CachedCompletion:
        """The whole response, for the response caches."""
        return p.CachedCompletion(model=model, usage=usage, max_tokens=max_tokens, choices=[
            p.CachedChoice(text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason)
            for _, c in sorted(self.choices.items())])
