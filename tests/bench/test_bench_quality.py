"""`tokenfleet bench quality`: its task set and scoring, its figures, and the harness end to end on a tiny
random checkpoint (float32, so that our engine and HF compute the same numbers up to rounding)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from bench.quality import Configuration, Settings, run
from bench.quality_tasks import Task, agreement, heldout_text, load_tasks, perplexity, windows
from services.launcher.cli import main


@pytest.fixture
def two_tasks(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"id": "ok", "prompt": "Reply with only the word OK.", "match": "exact",
                                "answer": "OK"}) + "\n" +
                    json.dumps({"id": "sum", "prompt": "What is 7 + 5?", "match": "regex", "answer": r"\b12\b"}))
    return path


def test_the_shipped_task_set_has_at_least_50_tasks_with_unique_ids_and_valid_regexes():
    tasks = load_tasks()
    assert len({t.id for t in tasks}) == len(tasks) >= 50
    for task in tasks:
        assert task.match in ("exact", "regex") and task.prompt and task.answer
        if task.match == "regex":
            re.compile(task.answer)


def test_an_exact_task_wants_the_stripped_answer_itself_case_and_all_unless_told_otherwise():
    task = Task("ok", "Reply with only the word OK.", "exact", "OK")
    assert task.is_right(" OK\n")
    assert not task.is_right("ok") and not task.is_right("OK, sure.")
    assert replace(task, ignore_case=True).is_right("ok")


def test_a_regex_task_wants_its_pattern_somewhere_in_the_answer():
    task = Task("capital", "What is the capital of France? Answer with one word.", "regex", r"(?i)\bparis\b")
    assert task.is_right("Paris.") and task.is_right("The capital of France is PARIS")
    assert not task.is_right("Lyon") and not task.is_right("Parisian")


def test_a_task_with_an_unknown_match_kind_or_a_broken_regex_is_refused():
    with pytest.raises(ValueError, match="match must be"):
        Task("x", "p", "fuzzy", "a")
    with pytest.raises(re.error):
        Task("x", "p", "regex", "(unclosed")


def test_perplexity_is_exp_of_the_mean_negative_log_likelihood_over_all_windows():
    result = perplexity([[-1.0, -2.0], [-3.0]])
    assert result["nll"] == pytest.approx(2.0) and result["tokens"] == 3
    assert result["perplexity"] == pytest.approx(7.389056)


def test_agreement_gives_each_prompts_first_divergence_and_share_of_equal_positions():
    result = agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert [p["first_divergence"] for p in result["prompts"]] == [2, None]
    assert [p["equal_pct"] for p in result["prompts"]] == [75.0, 100.0]
    assert result["mean_equal_pct"] == 87.5 and result["identical"] == 1
    assert result["median_first_divergence"] == 3  # (2 + 4) / 2: never diverging counts as past the last token


def test_held_out_windows_are_the_first_n_and_a_text_too_short_for_them_is_an_error():
    assert windows(list(range(10)), 3, 2) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="do not fit"):
        windows(list(range(10)), 4, 3)
    assert not heldout_text().startswith("#")  # the provenance paragraph is not part of the text


def test_a_configuration_against_itself_agrees_on_every_token_and_perplexity(make_checkpoint, two_tasks, tmp_path):
    out = tmp_path / "quality.json"
    assert main(["bench", "quality", "--model", str(make_checkpoint("llama")), "--dtype", "float32",
                 "--reference-dtype", "float32", "--windows", "2", "--window-len", "48", "--num-prompts", "2",
                 "--new-tokens", "12", "--task-tokens", "6", "--tasks", str(two_tasks), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["agreement"]["mean_equal_pct"] == 100.0 and r["agreement"]["identical"] == 2
    assert [p["first_divergence"] for p in r["agreement"]["prompts"]] == [None, None]
    ours, theirs = r["results"]["configuration"], r["results"]["reference"]
    assert ours["perplexity"] == theirs["perplexity"] and ours["perplexity"]["tokens"] == 2 * 47
    assert ours["tasks"] == theirs["tasks"] and [t["id"] for t in ours["tasks"]["results"]] == ["ok", "sum"]


def test_our_perplexity_equals_hf_transformers_on_the_same_float32_checkpoint(make_checkpoint, two_tasks):
    ours = Configuration(str(make_checkpoint("llama")), dtype="float32")
    settings = Settings(windows=2, window_len=48, prompts=2, new_tokens=12, task_tokens=6, tasks_path=two_tasks)
    r = run(ours, replace(ours, engine="hf"), settings)
    ppl = {side: r["results"][side]["perplexity"]["perplexity"] for side in ("configuration", "reference")}
    assert ppl["configuration"] == pytest.approx(ppl["reference"], rel=1e-4)
    assert r["agreement"]["mean_equal_pct"] == 100.0
