"""The learned tier classifier: trained on the shipped labeled set with the real MiniLM embedder, it separates
easy from hard prompts, and one threshold sets the share of traffic sent to the large tier."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import router
from cache.embedder import conversation_text
from router.classifier import TierClassifier, threshold_for_share
from router.train import add_arguments, embed_texts, holdout_split, main, read_labeled, train

SHIPPED = Path(router.__file__).parent / "data" / "labeled.jsonl"


@pytest.fixture(scope="module")
def shipped(embedder):
    """(vectors, small_ok) for every line of the shipped set."""
    examples = read_labeled(SHIPPED)
    return embed_texts(embedder, [e.text for e in examples]), np.array([e.small_ok for e in examples])


@pytest.fixture(scope="module")
def held_out(shipped):
    """A classifier fitted on 80 % of the shipped set, and its scores on the other 20 %."""
    vectors, small_ok = shipped
    train_idx, test_idx = holdout_split(small_ok, 0.2, seed=0)
    classifier = TierClassifier.fit(vectors[train_idx], small_ok[train_idx])
    return classifier, classifier.p_large(vectors[test_idx])


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_training_on_the_shipped_set_is_accurate_on_held_out_prompts(embedder, tmp_path):
    # Over 300 random splits held-out accuracy is 0.985 on average, never below 0.92; AUC never below 0.979.
    report = train(SHIPPED, tmp_path / "model.json", embedder, holdout=0.2, seed=0)
    assert report.accuracy >= 0.9
    assert report.auc >= 0.95
    assert report.trained_on + report.held_out == report.examples >= 200


def test_the_large_share_falls_from_all_to_none_as_the_threshold_rises(held_out):
    _, p_large = held_out
    shares = [float((p_large >= t).mean()) for t in np.linspace(0.0, 1.0, 11)]
    assert all(later <= earlier for earlier, later in zip(shares, shares[1:], strict=False)), shares
    assert shares[0] == 1.0 and shares[-1] == 0.0


@pytest.mark.parametrize("target", [0.0, 0.1, 0.3, 0.5, 0.8, 1.0])
def test_threshold_for_share_sends_the_target_share_to_the_large_tier(shipped, held_out, target):
    classifier, _ = held_out
    p_large = classifier.p_large(shipped[0])
    share = float((p_large >= threshold_for_share(p_large, target)).mean())
    assert share == pytest.approx(target, abs=1 / p_large.size)


def test_a_saved_and_loaded_classifier_predicts_identically(shipped, held_out, tmp_path):
    classifier, _ = held_out
    classifier.save(tmp_path / "model.json")
    loaded = TierClassifier.load(tmp_path / "model.json")
    assert np.array_equal(loaded.p_large(shipped[0]), classifier.p_large(shipped[0]))
    assert loaded.summary == classifier.summary


def test_a_clearly_hard_prompt_scores_higher_than_a_clearly_easy_one(embedder, held_out):
    classifier, _ = held_out
    hard, easy = classifier.p_large(embedder.embed([
        "Prove that there are infinitely many primes and then implement a segmented sieve in Rust",
        "Hi! How are you?"]))
    assert hard > 0.5 > easy


def test_a_chat_line_is_embedded_as_the_router_renders_the_conversation(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Spell 'necessary'."}]
    data = _write_lines(tmp_path / "chat.jsonl", [json.dumps({"messages": messages, "small_ok": True})])
    assert [e.text for e in read_labeled(data)] == [conversation_text(messages)]


@pytest.mark.parametrize("bad_line", [
    '{"prompt": "Hi", "small_ok": tru',  # not JSON
    '{"prompt": "Hi"}',  # no label
    '{"prompt": "Hi", "small_ok": "yes"}',  # label not a boolean
    '{"text": "Hi", "small_ok": true}',  # neither prompt nor messages
    '["Hi", true]',  # not an object
    '{"messages": ["Hi"], "small_ok": true}',  # messages not objects
])
def test_a_bad_data_line_is_a_value_error_naming_its_line(tmp_path, bad_line):
    good = json.dumps({"prompt": "Hello", "small_ok": True})
    data = _write_lines(tmp_path / "bad.jsonl", [good, "", bad_line, good])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: "):
        read_labeled(data)


def test_labels_of_one_class_only_are_refused():
    with pytest.raises(ValueError, match="both classes"):
        TierClassifier.fit(np.eye(4, 384), [True] * 4)


def test_a_model_file_of_another_dimension_is_refused(held_out, tmp_path):
    classifier, _ = held_out
    document_path = tmp_path / "model.json"
    classifier.save(document_path)
    document = json.loads(document_path.read_text())
    document.update(dimension=768, coef=document["coef"] * 2)
    document_path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="dimension 768"):
        TierClassifier.load(document_path)


def _cli(*argv: str) -> int:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return main(parser.parse_args(argv))


def test_the_cli_writes_a_loadable_model_and_prints_the_threshold_for_a_target_share(embedder, tmp_path, capsys):
    easy = ["Hello!", "What is 2 + 2?", "Translate 'cat' into French.", "How many grams in a kilogram?",
            "Is a whale a mammal?"]
    hard = ["Prove the fundamental theorem of algebra.", "Write a distributed key-value store in Rust with Raft.",
            "Design a global payment system with exactly-once semantics.",
            "Analyze the causes of the French Revolution in depth.", "Implement a JIT compiler for Lua in C."]
    data = _write_lines(tmp_path / "small.jsonl", [json.dumps({"prompt": p, "small_ok": p in easy})
                                                   for p in easy + hard])
    assert _cli("--data", str(data), "--out", str(tmp_path / "m.json"), "--target-large-share", "0.5") == 0
    assert "TOKENFLEET_ROUTER_CLASSIFIER_THRESHOLD=" in capsys.readouterr().out
    assert TierClassifier.load(tmp_path / "m.json").summary["examples"] == 10


def test_the_cli_reports_bad_data_and_exits_2(tmp_path, capsys):
    data = _write_lines(tmp_path / "bad.jsonl", ['{"prompt": "Hi", "small_ok": true}', "not json"])
    assert _cli("--data", str(data), "--out", str(tmp_path / "m.json")) == 2
    assert "bad.jsonl:2:" in capsys.readouterr().err
