"""The price table (list prices per model, cost per hour per worker class) and the cost of one task.

Two costs per task: the *list* cost (tokens x the model's prices: what a tenant is charged) and the
*measured* cost (the engine time the task really used x its worker's cost per hour: what it cost to serve).
Their ratio is utilization: a worker that idles or serves tiny batches costs far more per token than its list
price assumes. Cached-prefix tokens are charged at the cached-input price; a response-cache hit uses no
worker at all, so every one of its tokens is charged at the cached-input price and it has no measured cost.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PRICES = Path(__file__).with_name("default_prices.toml")
PER_TOKENS = 1_000_000


@dataclass(frozen=True)
class ModelPrice:
    input: float  # USD per 1 M tokens
    cached_input: float
    output: float


@dataclass(frozen=True)
class TaskCost:
    list_usd: float
    measured_usd: float


@dataclass(frozen=True)
class PriceTable:
    models: dict[str, ModelPrice]
    default: ModelPrice
    usd_per_hour: dict[str, float]  # worker class -> cost of one worker for an hour

    @classmethod
    def load(cls, path: str | Path | None = None) -> PriceTable:
        path = Path(path) if path else DEFAULT_PRICES
        try:
            raw = tomllib.loads(path.read_text())
            models = {name: ModelPrice(**entry) for name, entry in raw.get("models", {}).items()}
            default = ModelPrice(**raw["default"])
            hourly = {name: float(entry["usd_per_hour"]) for name, entry in raw.get("worker_classes", {}).items()}
        except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"price table {path}: {exc}") from exc
        return cls(models, default, hourly)

    def price(self, model: str) -> ModelPrice:
        return self.models.get(model, self.default)

    def list_cost(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                  response_cache_hit: bool = False) -> float:
        price = self.price(model)
        if response_cache_hit:
            return (prompt_tokens + completion_tokens) * price.cached_input / PER_TOKENS
        computed = prompt_tokens - cached_tokens
        return (computed * price.input + cached_tokens * price.cached_input
                + completion_tokens * price.output) / PER_TOKENS

    def estimate(self, model: str, prompt_tokens: int, max_tokens: int) -> float:
        """The most a request can cost at list price (no cache, every token it may generate): what a budget
        reserves at admission."""
        return self.list_cost(model, prompt_tokens, 0, max_tokens)

    def measured_cost(self, worker_class: str, gpu_seconds: float) -> float:
        """Unknown classes cost nothing rather than a guess; the ledger keeps the class to price them later."""
        return gpu_seconds * self.usd_per_hour.get(worker_class, 0.0) / 3600
