"""`tokenfleet router train`: fit the tier classifier on labeled prompts, report how it does on a held-out split,
and write the model file that TOKENFLEET_ROUTER_CLASSIFIER_PATH points at.

Data: JSONL, one request a line, `{"prompt": "..." | "messages": [...], "small_ok": true | false}`, where
small_ok says the small model's answer was good enough. Chat messages are rendered as the router renders them
(`conversation_text`), so training and serving embed the same text.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cache.embedder import conversation_text, shared_embedder

from .classifier import TierClassifier, threshold_for_share

REPORT_THRESHOLDS = (0.3, 0.5, 0.7)
EMBED_BATCH = 64  # bounds the padded batch the embedder holds at once


@dataclass(frozen=True)
class LabeledPrompt:
    text: str
    small_ok: bool


@dataclass(frozen=True)
class TrainReport:
    examples: int
    trained_on: int
    held_out: int
    small_ok_share: float  # of all examples
    accuracy: float | None  # on the held-out split at threshold 0.5; None when nothing was held out
    auc: float | None
    large_share: dict[float, float]  # threshold -> share of held-out prompts sent to the large tier
    target_large_share: float | None
    threshold_for_target: float | None  # the threshold giving target_large_share on the held-out scores
    out_path: str

    def lines(self) -> list[str]:
        out = [f"examples: {self.examples} ({self.small_ok_share:.0%} small_ok), "
               f"trained on {self.trained_on}, held out {self.held_out}"]
        if self.accuracy is not None:
            auc = "n/a (one class held out)" if self.auc is None else f"{self.auc:.3f}"
            out.append(f"held-out accuracy {self.accuracy:.3f}, AUC {auc}")
            shares = ", ".join(f"{t:g}: {s:.0%}" for t, s in self.large_share.items())
            out.append(f"held-out share to the large tier by threshold: {shares}")
        if self.threshold_for_target is not None:
            out.append(f"threshold for {self.target_large_share:.0%} to the large tier: {self.threshold_for_target:.3f}"
                       f" (TOKENFLEET_ROUTER_CLASSIFIER_THRESHOLD={self.threshold_for_target:.3f})")
        out.append(f"wrote {self.out_path} (TOKENFLEET_ROUTER_CLASSIFIER_PATH={self.out_path})")
        return out


def _parse_line(line: str) -> LabeledPrompt:
    row = json.loads(line)
    if not isinstance(row, dict):
        raise ValueError("expected a JSON object")
    if not isinstance(row.get("small_ok"), bool):
        raise ValueError('"small_ok" must be true or false')
    messages = row.get("messages")
    if isinstance(messages, list):
        if not all(isinstance(message, dict) for message in messages):
            raise ValueError('"messages" must be a list of objects')
        text = conversation_text(messages)
    elif isinstance(row.get("prompt"), str):
        text = row["prompt"]
    else:
        raise ValueError('needs "prompt" (a string) or "messages" (a list)')
    if not text.strip():
        raise ValueError("empty prompt")
    return LabeledPrompt(text, row["small_ok"])


def read_labeled(path: str | Path) -> list[LabeledPrompt]:
    """Blank lines are skipped; any other bad line is a ValueError naming the file and line number."""
    examples = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                examples.append(_parse_line(line))
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{number}: {err}") from err
    return examples


def embed_texts(embedder, texts: list[str]) -> np.ndarray:
    """Batched in length order: a batch is padded to its longest text, so mixing one-liners with long
    prompts would waste most of the forward pass on padding."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    batches = [embedder.embed([texts[i] for i in order[start:start + EMBED_BATCH]])
               for start in range(0, len(order), EMBED_BATCH)]
    vectors = np.empty((len(texts), batches[0].shape[1]), dtype=np.float32)
    vectors[order] = np.concatenate(batches)
    return vectors


def holdout_split(labels: np.ndarray, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified, so a small held-out set still has both classes in the data's proportion."""
    indices = np.arange(labels.size)
    if holdout == 0:
        return indices, indices[:0]
    from sklearn.model_selection import train_test_split

    train_idx, test_idx = train_test_split(indices, test_size=holdout, random_state=seed, stratify=labels)
    return train_idx, test_idx


def train(data_path: str | Path, out_path: str | Path, embedder, holdout: float = 0.2, seed: int = 0,
          target_large_share: float | None = None) -> TrainReport:
    """Fits on all but the held-out split (the file written is the model the report describes). holdout=0 trains
    on everything and reports no held-out metrics; the target share is then calibrated on the training scores."""
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    if target_large_share is not None and not 0.0 <= target_large_share <= 1.0:
        raise ValueError(f"target large share must be between 0 and 1, got {target_large_share}")
    examples = read_labeled(data_path)
    if not examples:
        raise ValueError(f"{data_path}: no examples")
    small_ok = np.array([e.small_ok for e in examples])
    vectors = embed_texts(embedder, [e.text for e in examples])
    train_idx, test_idx = holdout_split(small_ok, holdout, seed)
    classifier = TierClassifier.fit(vectors[train_idx], small_ok[train_idx])
    metrics = (_held_out_metrics(classifier, vectors[test_idx], small_ok[test_idx]) if test_idx.size
               else {"accuracy": None, "auc": None, "large_share": {}})
    classifier = replace(classifier, summary={
        **classifier.summary, "data": Path(data_path).name, "examples": len(examples),
        "trained_on": int(train_idx.size), "held_out": int(test_idx.size), "seed": seed,
        "held_out_accuracy": metrics["accuracy"], "held_out_auc": metrics["auc"]})
    threshold = None
    if target_large_share is not None:  # unseen prompts score like live traffic; training ones are overconfident
        calibration_idx = test_idx if test_idx.size else train_idx
        threshold = threshold_for_share(classifier.p_large(vectors[calibration_idx]), target_large_share)
    classifier.save(out_path)
    return TrainReport(examples=len(examples), trained_on=int(train_idx.size), held_out=int(test_idx.size),
                       small_ok_share=float(small_ok.mean()), accuracy=metrics["accuracy"], auc=metrics["auc"],
                       large_share=metrics["large_share"], target_large_share=target_large_share,
                       threshold_for_target=threshold, out_path=str(out_path))


def _held_out_metrics(classifier: TierClassifier, vectors: np.ndarray, small_ok: np.ndarray) -> dict:
    from sklearn.metrics import roc_auc_score

    p_large = classifier.p_large(vectors)
    needs_large = ~small_ok
    return {"accuracy": float(((p_large >= 0.5) == needs_large).mean()),
            "auc": float(roc_auc_score(needs_large, p_large)) if 0 < needs_large.sum() < needs_large.size else None,
            "large_share": {t: float((p_large >= t).mean()) for t in REPORT_THRESHOLDS}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help='JSONL: {"prompt" or "messages", "small_ok": bool} per line')
    parser.add_argument("--out", default="router-classifier.json", help="model file to write (JSON)")
    parser.add_argument("--holdout", type=float, default=0.2, help="share held out for the report (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-large-share", type=float, default=None,
                        help="also print the threshold that sends this share of prompts to the large tier")


def main(args: argparse.Namespace) -> int:
    try:
        report = train(args.data, args.out, shared_embedder(), holdout=args.holdout, seed=args.seed,
                       target_large_share=args.target_large_share)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(report.lines()))
    return 0
