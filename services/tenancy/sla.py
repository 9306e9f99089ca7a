"""SLA classes and what the ledger derives from them: whether a task met its SLA, goodput (tasks meeting
their SLA per second, as vLLM defines it), attainment (the share meeting it), latency percentiles."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_SLA = Path(__file__).with_name("sla_classes.toml")


@dataclass(frozen=True)
class SlaClass:
    name: str
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    timeout_s: float | None = None  # its requests' deadline after acceptance; None: the gateway's request timeout

    def met(self, ttft_s: float, tpot_s: float, e2e_s: float, ok: bool = True) -> bool:
        """Only a task that finished can meet an SLA; an objective the class does not set always holds."""
        limits = ((self.ttft_s, ttft_s), (self.tpot_s, tpot_s), (self.e2e_s, e2e_s))
        return ok and all(limit is None or value <= limit for limit, value in limits)


@dataclass(frozen=True)
class SlaPolicy:
    classes: dict[str, SlaClass]
    default: str

    @classmethod
    def load(cls, path: str | Path | None = None) -> SlaPolicy:
        path = Path(path) if path else DEFAULT_SLA
        try:
            raw = tomllib.loads(path.read_text())
            classes = {name: SlaClass(name, **objectives) for name, objectives in raw["classes"].items()}
            policy = cls(classes, raw["default"])
        except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"SLA classes {path}: {exc}") from exc
        if policy.default not in classes:
            raise ValueError(f"SLA classes {path}: the default {policy.default!r} is not a class")
        return policy

    def of(self, name: str | None) -> SlaClass:
        """The named class; an unknown or missing name gets the default (the ledger records which applied)."""
        return self.classes.get(name or self.default) or self.classes[self.default]


@dataclass(frozen=True)
class Attainment:
    tasks: int
    met: int
    window_s: float

    @property
    def goodput(self) -> float:
        """Tasks meeting their SLA per second of the window."""
        return self.met / self.window_s if self.window_s > 0 else 0.0

    @property
    def share(self) -> float:
        return self.met / self.tasks if self.tasks else 0.0


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 95, 99)) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in ps}
    return {f"p{p}": float(np.percentile(np.asarray(values, dtype=float), p)) for p in ps}
