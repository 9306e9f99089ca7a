"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.text.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """What vLLM users know: temperature 0 is greedy; top_k <= 0 and top_p = 1 disable those filters."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 16
    ignore_eos: bool = False
    logprobs: int | None = None
    # 0: the log-probability of each prompt token given the ones before it (perplexity). Such a request
    # computes its whole prompt: it takes no blocks from the prefix cache.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        floats = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        for name in floats:  # inf passes every range check below, and NaN fails none of them
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be a finite number, got {getattr(self, name)}", name)
        checks = [
            (-(2**31) < self.top_k < 2**31, "top_k", f"top_k must fit in 32 bits, got {self.top_k}"),
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0.0, "temperature", f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0.0, "repetition_penalty",
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs in (None, 0), "prompt_logprobs",
             f"prompt_logprobs must be 0 (each prompt token's own; top-N is not implemented), "
             f"got {self.prompt_logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
