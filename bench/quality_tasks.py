"""What `tokenfleet bench quality` measures on, and how it scores: the held-out text, the open-ended prompts of
the greedy comparison, the task set with checked answers, and the three figures computed from them."""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).parent / "data"
HELDOUT_PATH = DATA / "heldout.txt"
TASKS_PATH = DATA / "quality_tasks.jsonl"
# A shipped copy rather than `pydoc_data.topics` read at run time: that module is regenerated with every Python
# release, and perplexities are only comparable on the very same text.
HELDOUT_SOURCE = ("Python 3.11.7 documentation, pydoc_data.topics: execmodel, import, objects, assignment, "
                  "raise, class, with; Copyright Python Software Foundation, PSF License Agreement")

# Open-ended, so that 256 greedy tokens have somewhere to go (the task prompts want a word or two).
OPEN_PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe your ideal weekend.",
    "What are some tips for learning a new language?",
    "Explain why the sky is blue.",
    "Write a poem about autumn leaves.",
    "Describe how to make a cup of tea.",
    "What are the benefits of regular exercise?",
    "Explain what a computer program is to a child.",
    "Write a letter to a friend about a recent trip.",
    "Describe a busy city street in the morning.",
    "What makes a good teacher?",
    "Explain how plants grow from seeds.",
    "Write a short dialogue between a cat and a dog.",
    "Describe the water cycle.",
    "Give advice to someone starting their first job.",
    "Explain how a library organizes its books.",
    "Write a recipe for a simple vegetable soup.",
    "Describe the ocean to someone who has never seen it.",
    "What are some ways to save energy at home?",
    "Explain how a rainbow forms.",
    "Write a short story about a robot who learns to paint.",
    "Describe a day in the life of a farmer.",
    "Why is sleep important?",
    "Explain how to plant a tree.",
    "Write a product description for a comfortable chair.",
    "Describe the sounds of a forest at night.",
    "What should someone pack for a camping trip?",
    "Explain how trains run on tracks.",
    "Write a thank-you note to a neighbor.",
    "Describe how bread is made.",
    "What are the seasons of the year and how do they differ?",
)


def heldout_text(path: Path = HELDOUT_PATH) -> str:
    """The file's first paragraph is its provenance; the text is everything after it."""
    return path.read_text(encoding="utf-8").split("\n\n", 1)[1]


def windows(token_ids: list[int], length: int, count: int) -> list[list[int]]:
    """The first `count` non-overlapping windows of `length` tokens: a fixed count, or figures would not compare."""
    if count * length > len(token_ids):
        raise ValueError(f"the held-out text has {len(token_ids)} tokens: {count} windows of {length} do not fit")
    return [token_ids[i * length:(i + 1) * length] for i in range(count)]


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    match: str  # "exact": the stripped answer equals `answer`; "regex": `answer` is found in it
    answer: str
    ignore_case: bool = False  # for "exact" (a regex says so itself, with (?i))

    def __post_init__(self) -> None:
        if self.match not in ("exact", "regex"):
            raise ValueError(f"task {self.id}: match must be 'exact' or 'regex', not {self.match!r}")
        if self.match == "regex":
            re.compile(self.answer)

    def is_right(self, output: str) -> bool:
        if self.match == "regex":
            return re.search(self.answer, output) is not None
        if self.ignore_case:
            return output.strip().casefold() == self.answer.casefold()
        return output.strip() == self.answer


def load_tasks(path: Path = TASKS_PATH) -> list[Task]:
    tasks = [Task(**json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: task ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    return tasks


def task_scores(tasks: list[Task], outputs: list[str]) -> dict:
    results = [{"id": t.id, "right": t.is_right(out), "output": out} for t, out in zip(tasks, outputs, strict=True)]
    return {"accuracy": sum(r["right"] for r in results) / len(results), "results": results}


def perplexity(logprobs: list[list[float]]) -> dict:
    """exp of the mean negative log-likelihood over every predicted token of every window."""
    values = [v for window in logprobs for v in window]
    nll = -sum(values) / len(values)
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": len(values)}


def _compare(ours: list[int], reference: list[int]) -> dict:
    same = [a == b for a, b in zip(ours, reference, strict=False)]
    first = next((i for i, s in enumerate(same) if not s), None)
    if first is None and len(ours) != len(reference):  # one stopped early (the context limit): it diverges there
        first = len(same)
    return {"first_divergence": first, "equal_pct": 100 * sum(same) / max(len(ours), len(reference), 1)}


def agreement(ours: list[list[int]], reference: list[list[int]]) -> dict:
    """Per prompt: where the greedy tokens first differ (None: never) and the share of positions that are equal.
    In the median, a prompt that never diverges counts as diverging just past its last token."""
    prompts = [_compare(a, b) for a, b in zip(ours, reference, strict=True)]
    firsts = [p["first_divergence"] if p["first_divergence"] is not None else max(len(a), len(b))
              for p, a, b in zip(prompts, ours, reference, strict=True)]
    return {"mean_equal_pct": statistics.mean(p["equal_pct"] for p in prompts),
            "median_first_divergence": statistics.median(firsts),
            "identical": sum(p["first_divergence"] is None for p in prompts), "prompts": prompts}
