"""model="auto" with a learned classifier: the length rule first, then the classifier's verdict on what the
rule left to the small tier, with the probability and threshold in the recorded reason."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import router
from router.classifier import TierClassifier
from router.policy import TierPolicy, TierRule, route
from router.train import embed_texts, read_labeled
from services.base import protocol as p
from services.text.prompt_encoder import PromptEncoder

RULE = TierRule("small", "large", max_prompt_tokens=100, max_tokens=50)
BOTH = {"small", "large"}


def _request(content: str, max_tokens: int | None = 20) -> p.GenerateRequest:
    return p.GenerateRequest(request_id="r", kind="chat", model="auto", messages=[{"role": "user", "content": content}],
                             sampling=p.SamplingOptions(max_tokens=max_tokens))


def test_the_classifier_sends_to_the_large_tier_at_or_above_the_threshold():
    model, reason = route(_request("x"), RULE, 10, BOTH, large_probability=0.7, threshold=0.6)
    assert model == "large" and "classifier P(small not enough) 0.70 >= 0.6" in reason
    assert route(_request("x"), RULE, 10, BOTH, large_probability=0.5, threshold=0.6)[0] == "small"


def test_the_length_rule_decides_before_the_classifier():
    assert route(_request("x", max_tokens=None), RULE, 10, BOTH, large_probability=0.0)[0] == "large"


@pytest.fixture(scope="module")
def policy(embedder) -> TierPolicy:
    examples = read_labeled(Path(router.__file__).parent / "data" / "labeled.jsonl")
    classifier = TierClassifier.fit(embed_texts(embedder, [e.text for e in examples]),
                                    np.array([e.small_ok for e in examples]))
    return TierPolicy(RULE, classifier, 0.5, embedder)


def test_a_trained_policy_keeps_an_easy_prompt_small_and_sends_a_hard_one_large(policy):
    def choose(content: str) -> str:
        return asyncio.run(policy.choose(_request(content), {}, PromptEncoder(), BOTH))[0]

    assert choose("Hi there, how are you today?") == "small"
    assert choose("Design a distributed, fault-tolerant rate limiter and prove its correctness.") == "large"
