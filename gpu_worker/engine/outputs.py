"""What the engine hands back: per request, one `CompletionOutput` per sample (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per position: sampled token and top-N

    def extend(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class RequestOutput:
    """From `LLMEngine.step` and the async engine, `outputs` hold deltas; `LLM.generate` returns totals.

    `token_ids`, `text`, `finish_reason` and `logprobs` read the first sample, for the common n = 1.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    engine_seconds: float = 0.0  # so far: the request's share of measured step time, by tokens processed
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[float | None] | None = None  # with SamplingParams(prompt_logprobs=0); entry 0 is None
    num_draft_tokens: int = 0  # so far: speculative guesses scored for the request, and those its samples kept
    num_accepted_draft_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs
