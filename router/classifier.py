"""The learned tier classifier for model="auto" (RouteLLM-style): logistic regression over prompt embeddings
predicting whether the small model does NOT suffice, so one threshold on that probability sets the share of
traffic sent to the large model.

The model file is a small JSON document (coefficients, intercept, the embedder it was trained on); prediction is
one dot product in numpy, so the router needs neither pickle nor scikit-learn at serving time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cache.embedder import DIM

EMBEDDER_NAME = "all-MiniLM-L6-v2"
FORMAT = "tokenfleet-tier-classifier/1"
# Inverse L2 strength, scikit-learn's default. On router/data/labeled.jsonl held-out accuracy is the same from C=1
# to C=100, but a larger C pushes every probability to 0 or 1, which leaves the threshold a coarse knob (the
# held-out share to the large tier moves 0.68 -> 0.34 from threshold 0.3 to 0.7 at C=1, 0.54 -> 0.47 at C=10).
DEFAULT_C = 1.0


@dataclass(frozen=True)
class TierClassifier:
    """P(the small model does not suffice | prompt embedding) = sigmoid(vector . coef + intercept)."""

    coef: np.ndarray  # (dimension,) float64
    intercept: float
    embedder: str = EMBEDDER_NAME
    summary: dict = field(default_factory=dict)  # how it was trained: counts, held-out metrics; informational

    @property
    def dimension(self) -> int:
        return int(self.coef.shape[0])

    @classmethod
    def fit(cls, vectors: np.ndarray, small_ok: np.ndarray | list[bool], *, c: float = DEFAULT_C,
            summary: dict | None = None) -> TierClassifier:
        """`vectors`: (n, dimension) embeddings; `small_ok[i]`: the small model's answer to prompt i was good enough.

        Classes are weighted balanced: a labeled set's easy/hard mix is an accident of how it was collected, not
        the live traffic's, and unweighted the model would lean to the majority label. The share actually sent
        to the large tier is then set by the threshold (see `threshold_for_share`), not by the label mix.
        """
        from sklearn.linear_model import LogisticRegression

        vectors = np.asarray(vectors, dtype=np.float64)
        needs_large = ~np.asarray(small_ok, dtype=bool)
        if vectors.ndim != 2 or vectors.shape[0] != needs_large.shape[0]:
            raise ValueError(f"vectors {vectors.shape} and {needs_large.shape[0]} labels do not match")
        if needs_large.all() or not needs_large.any():
            label = "small_ok=false" if needs_large.all() else "small_ok=true"
            raise ValueError(f"every example is {label}: the classifier needs examples of both classes")
        model = LogisticRegression(C=c, class_weight="balanced", max_iter=1000).fit(vectors, needs_large)
        return cls(coef=model.coef_[0].astype(np.float64), intercept=float(model.intercept_[0]),
                   summary={"c": c, "class_weight": "balanced", **(summary or {})})

    def p_large(self, vectors: np.ndarray) -> np.ndarray:
        """(n,) probabilities that the small model does not suffice, for (n, dimension) embeddings."""
        vectors = np.asarray(vectors, dtype=np.float64)
        if vectors.ndim != 2 or vectors.shape[1] != self.dimension:
            raise ValueError(f"expected (n, {self.dimension}) embeddings, got shape {vectors.shape}")
        logits = vectors @ self.coef + self.intercept
        return 0.5 * (1.0 + np.tanh(0.5 * logits))  # the logistic function, without overflow for large |logit|

    def save(self, path: str | Path) -> None:
        document = {"format": FORMAT, "embedder": self.embedder, "dimension": self.dimension,
                    "intercept": self.intercept, "coef": self.coef.tolist(), "summary": self.summary}
        Path(path).write_text(json.dumps(document, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, *, dimension: int = DIM, embedder: str = EMBEDDER_NAME) -> TierClassifier:
        """Refuses a file made for another embedder or dimension: its scores would be meaningless here."""
        try:
            document = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not a tier classifier file: {err}") from err
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise ValueError(f"{path}: not a tier classifier file (format is not {FORMAT!r})")
        if document.get("embedder") != embedder:
            raise ValueError(f"{path}: trained on embeddings from {document.get('embedder')!r}, "
                             f"this router embeds with {embedder!r}")
        coef = np.asarray(document.get("coef"), dtype=np.float64)
        if document.get("dimension") != dimension or coef.shape != (dimension,):
            raise ValueError(f"{path}: model of dimension {document.get('dimension')} with {coef.size} "
                             f"coefficients, the embedder gives {dimension}")
        intercept = float(document["intercept"])
        if not (math.isfinite(intercept) and np.isfinite(coef).all()):
            raise ValueError(f"{path}: non-finite coefficients")
        return cls(coef=coef, intercept=intercept, embedder=embedder, summary=document.get("summary") or {})


def threshold_for_share(p_large_values: np.ndarray, share: float) -> float:
    """The threshold that sends `share` of these requests to the large tier (large when p_large >= threshold).

    RouteLLM's calibration: score a sample of real traffic, then pick the threshold by the share of it the
    large model can afford, since a probability cut-off by itself says nothing about cost.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be between 0 and 1, got {share}")
    ranked = np.sort(np.asarray(p_large_values, dtype=np.float64).ravel())[::-1]
    if ranked.size == 0:
        raise ValueError("no p_large values to calibrate on")
    count = round(share * ranked.size)
    if count == 0:
        return float(np.nextafter(ranked[0], np.inf))  # just above the highest score: none go large
    if count == ranked.size:
        return float(ranked[-1])
    # Halfway between the last score in and the first out: new traffic near the boundary splits evenly.
    return float((ranked[count - 1] + ranked[count]) / 2)
