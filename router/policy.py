"""Which model serves a request: the one it names, or for model="auto" a tier by a size rule."""

from __future__ import annotations

from dataclasses import dataclass

from services import protocol as p


@dataclass(frozen=True)
class TierRule:
    """Small prompts asking for short outputs go to the small tier; everything else to the large one."""

    small_model: str
    large_model: str
    max_prompt_tokens: int
    max_tokens: int

    def choose(self, prompt_tokens: int, max_tokens: int | None) -> tuple[str, str]:
        if prompt_tokens > self.max_prompt_tokens:
            return self.large_model, f"auto: prompt {prompt_tokens} tokens > {self.max_prompt_tokens}"
        if max_tokens is None or max_tokens > self.max_tokens:
            return self.large_model, f"auto: max_tokens {max_tokens} > {self.max_tokens}"
        return self.small_model, (f"auto: prompt {prompt_tokens} <= {self.max_prompt_tokens} tokens and "
                                  f"max_tokens {max_tokens} <= {self.max_tokens}")


def route(request: p.GenerateRequest, rule: TierRule, prompt_tokens: int | None,
          alive: set[str]) -> tuple[str, str]:
    """`alive`: models with a live worker; model="auto" falls back to the other tier rather than wait."""
    if request.model != p.AUTO_MODEL:
        return request.model, "named by the request"
    model, reason = rule.choose(prompt_tokens or 0, request.sampling.max_tokens)
    other = rule.large_model if model == rule.small_model else rule.small_model
    if model not in alive and other in alive:
        return other, f"{reason}; {model} has no live worker"
    return model, reason
