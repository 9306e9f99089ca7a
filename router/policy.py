"""Which model serves a request: the one it names, or for model="auto" a tier: (1) a size rule, then
(2) for what the rule leaves to the small tier, a learned classifier's estimate that the small model will
not do (RouteLLM-style: one threshold sets the share sent to the large tier)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cache.embedder import conversation_text
from services.base import protocol as p
from services.text.prompt_encoder import PromptEncoder

if TYPE_CHECKING:  # both load torch and scikit-learn: only a router with a classifier needs them
    from cache.embedder import Embedder
    from router.classifier import TierClassifier


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


def route(request: p.GenerateRequest, rule: TierRule, prompt_tokens: int | None, alive: set[str],
          large_probability: float | None = None, threshold: float = 0.5) -> tuple[str, str]:
    """`alive`: models with a live worker; model="auto" falls back to the other tier rather than wait.
    `large_probability`: the classifier's P(the small model does not suffice), when there is one."""
    if request.model != p.AUTO_MODEL:
        return request.model, "named by the request"
    model, reason = rule.choose(prompt_tokens or 0, request.sampling.max_tokens)
    if model == rule.small_model and large_probability is not None:
        verdict = ">=" if large_probability >= threshold else "<"
        reason += f"; classifier P(small not enough) {large_probability:.2f} {verdict} {threshold}"
        if large_probability >= threshold:
            model = rule.large_model
    other = rule.large_model if model == rule.small_model else rule.small_model
    if model not in alive and other in alive:
        return other, f"{reason}; {model} has no live worker"
    return model, reason


@dataclass
class TierPolicy:
    """`route` with its inputs computed: the prompt's size in the small model's tokens, its embedding."""

    rule: TierRule
    classifier: TierClassifier | None = None
    threshold: float = 0.5
    embedder: Embedder | None = None  # needed with a classifier

    def models(self) -> tuple[str, str]:
        return self.rule.small_model, self.rule.large_model

    async def choose(self, request: p.GenerateRequest, models: dict[str, p.ModelInfo], encoder: PromptEncoder,
                     alive: set[str]) -> tuple[str, str]:
        if request.model != p.AUTO_MODEL:
            return route(request, self.rule, None, alive)
        text = conversation_text(request.messages, request.prompt)
        small = models.get(self.rule.small_model)
        ids = await encoder.prompt_ids_async(request, self.rule.small_model, small.model_dir) if small else None
        prompt_tokens = len(ids) if ids is not None else len(text) // 4  # no tokenizer here: ~4 characters each
        large_probability = None
        if self.classifier is not None and self.embedder is not None:
            vector = await asyncio.to_thread(self.embedder.embed_one, text)
            large_probability = float(self.classifier.p_large(vector[None])[0])
        return route(request, self.rule, prompt_tokens, alive, large_probability, self.threshold)
