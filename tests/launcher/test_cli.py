"""The `tokenfleet` console script, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpu_worker.engine import LLM, SamplingParams


def _tokenfleet(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launcher.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return str(make_checkpoint("llama"))


def test_generate_prints_the_greedy_completion(model_dir):
    expected = LLM(model_dir).generate("Hello world", SamplingParams(temperature=0.0, max_tokens=12))[0].text
    proc = _tokenfleet("generate", "--model", model_dir, "--max-tokens", "12", "Hello world")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"


def test_generate_stream_prints_the_same_text(model_dir):
    plain = _tokenfleet("generate", "--model", model_dir, "--max-tokens", "12", "Hello world")
    streamed = _tokenfleet("generate", "--model", model_dir, "--max-tokens", "12", "--stream", "Hello world")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == plain.stdout


def test_generate_answers_with_the_trained_default_model_in_its_chat_template():
    # Not "the capital of France": its first two tokens are 0.08 nats apart in float32, within what bf16 rounding
    # moves them (bench/RESULTS.md), so a bf16 greedy answer to it depends on the CPU's kernels.
    proc = _tokenfleet("generate", "--chat", "What is the capital of Germany?")
    assert proc.returncode == 0, proc.stderr
    assert "Berlin" in proc.stdout


def test_generate_names_a_model_that_is_neither_known_nor_a_path():
    proc = _tokenfleet("generate", "--model", "no-such-model", "Hello")
    assert proc.returncode == 2
    assert "smollm2-135m-instruct" in proc.stderr and "no-such-model" in proc.stderr


def test_generate_rejects_bad_input_with_a_message(model_dir):
    proc = _tokenfleet("generate", "--model", model_dir, "--max-tokens", "0", "Hello")
    assert proc.returncode == 2
    assert "max_tokens" in proc.stderr


def test_bench_engine_interleaves_ours_and_each_peer_in_rounds_on_the_mixed_workload_asked_for(model_dir, tmp_path):
    out = tmp_path / "bench.json"
    proc = _tokenfleet("bench", "engine", "--model", model_dir, "--dtype", "fp32", "--num-requests", "3",
                       "--prompt-range", "20", "40", "--output-range", "2", "6", "--rounds", "2", "--repeats", "1",
                       "--peer", "hf", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert [pair["order"] for rnd in figures["rounds"] for pair in rnd["pairs"]] == (
        [["tokenfleet", "hf-generate"]] * 2 + [["hf-generate", "tokenfleet"]] * 2)
    assert set(figures["batch1_tps"]) == set(figures["mixed_tps"]) == {"tokenfleet", "hf-generate"}
    for workload in ("batch1", "mixed"):
        ratio = figures["ratios"][workload]["hf-generate"]
        assert len(ratio["values"]) == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
    assert all(rnd["read_bandwidth_gbs"] > 0 for rnd in figures["rounds"])
    assert figures["host"]["threads"] >= 1 and figures["host"]["cpus"]
    assert figures["mixed_workload"] == {"requests": 3, "prompt_range": [20, 40], "output_range": [2, 6]}
    assert "| mixed | hf-generate |" in proc.stdout and "ISA" in proc.stdout
    assert "mixed workload: 3 requests at once, prompts of 20-40 tokens, 2-6 out" in proc.stdout


def test_bench_spec_reports_each_proposer_against_no_speculation_per_prompt_set_and_batch(model_dir, tmp_path):
    out = tmp_path / "spec.json"
    proc = _tokenfleet("bench", "spec", "--model", model_dir, "--dtype", "float32", "--rounds", "1",
                       "--max-tokens", "8", "--batches", "1,4", "--methods", "ngram,self-int8", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    sets = json.loads(out.read_text())["sets"]
    assert set(sets) == {"quote, batch 1", "quote, batch 4", "chat, batch 1", "chat, batch 4"}
    assert all(set(s["methods"]) == {"ngram", "self-int8"} and s["tps_off"] > 0 for s in sets.values())
    assert all(f["tps"] > 0 and f["tokens_per_forward"] >= 1 for s in sets.values() for f in s["methods"].values())
    assert sets["chat, batch 1"]["methods"]["self-int8"]["acceptance"] > 0
    assert "| quote, batch 1 | self-int8 |" in proc.stdout


def test_bench_prefix_reports_ttft_with_caching_on_and_off(model_dir, tmp_path):
    out = tmp_path / "prefix.json"
    proc = _tokenfleet("bench", "prefix", "--model", model_dir, "--dtype", "float32", "--num-requests", "4",
                       "--prefix-len", "300", "--json", str(out))  # two whole blocks of the CPU's 128 tokens
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert set(figures["ttft_ms"]) == {"on", "off"} and figures["hit_rate"] > 0.5
    assert "median TTFT off / on" in proc.stdout


def test_accounting_migrate_brings_the_ledger_schema_up_and_exits(tmp_path):
    database = tmp_path / "ledger.db"
    proc = subprocess.run([sys.executable, "-m", "services.launcher.cli", "accounting", "--migrate"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "DATABASE_URL": f"sqlite:///{database}"})
    assert proc.returncode == 0, proc.stderr
    import sqlite3

    tables = {row[0] for row in sqlite3.connect(database).execute("SELECT name FROM sqlite_master")}
    assert {"ledger", "alembic_version"} <= tables, tables
