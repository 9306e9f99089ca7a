"""bench/lab: the experiments run as scripts (`python -m bench.lab.NAME`), and nothing outside the folder imports
them, so that no user command depends on one."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_worker.engine.kernels import cpu_kernels

REPO = Path(__file__).resolve().parents[2]


def _lab(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"bench.lab.{name}", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return str(make_checkpoint("llama"))


def _imports(path: Path) -> set[str]:
    """The modules `path` imports, relative imports resolved against its package."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, (base, node.module)))
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return found


def test_nothing_outside_the_lab_imports_it():
    sources = [p for folder in ("bench", "services", "gateway", "router", "cache", "gpu_worker")
               for p in (REPO / folder).rglob("*.py") if "lab" not in p.relative_to(REPO).parts]
    importers = [str(p.relative_to(REPO)) for p in sources
                 if any(m == "bench.lab" or m.startswith("bench.lab.") for m in _imports(p))]
    assert importers == []


def test_no_user_command_is_a_lab_experiment():
    from services.launcher.cli import BENCHMARKS

    assert not [name for name, (module, _) in BENCHMARKS.items() if module.startswith("bench.lab")]
    assert all((REPO / (module.replace(".", "/") + ".py")).is_file() for module, _ in BENCHMARKS.values())


@pytest.mark.skipif(cpu_kernels() is None, reason="batch-invariant mode needs AVX512-BF16")
def test_deterministic_reports_each_workloads_cost_per_round(make_checkpoint, tmp_path):
    # head_dim 32, which the batch-invariant attention takes
    model = make_checkpoint("llama", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)
    out = tmp_path / "deterministic.json"
    proc = _lab("deterministic", "--model", str(model), "--rounds", "2", "--batch", "2", "--max-tokens", "4",
                "--prefill-len", "40", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())["figures"]
    assert set(figures) == {"decode b1", "decode bN", "prefill"}
    assert all(f["default"] > 0 and f["deterministic"] > 0 and f["ratio"][1] <= f["ratio"][0] <= f["ratio"][2]
               for f in figures.values())
    assert "prefill, 40 tokens" in proc.stdout


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_decode_parts_reports_attention_and_projections_from_memory_and_from_cache(model_dir, tmp_path,
                                                                                   kv_cache_dtype):
    out = tmp_path / "parts.json"
    proc = _lab("decode_parts", "--model", model_dir, "--rows", "4", "--context", "20", "40",
                "--kv-cache-dtype", kv_cache_dtype, "--rounds", "2", "--repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert figures["kv_cache_dtype"] == kv_cache_dtype and len(figures["rounds"]) == 2
    assert figures["kv_bytes_per_layer"] > 0 < figures["weight_bytes_per_layer"]
    readings = ("attention, every layer", "attention, one layer", "projections, every layer",
                "projections, one layer")
    assert all(rnd["read_gbs"] > 0 and all(rnd[r] > 0 for r in readings) for rnd in figures["rounds"])
    assert "| attention, every layer |" in proc.stdout and "| projections, one layer |" in proc.stdout


@pytest.mark.skipif(cpu_kernels() is None, reason="the bf16 GEMV needs AVX512-BF16")
def test_gemv_plans_reports_every_plan_against_the_engines_own(model_dir, tmp_path):
    out = tmp_path / "gemv.json"
    proc = _lab("gemv_plans", "--model", model_dir, "--rows", "1,3", "--plans", "4x0,1x3", "--rounds", "2",
                "--repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert set(figures["rows"]) == {"1", "3"} and figures["weight_bytes"] > 0
    for reading in figures["rows"].values():
        assert {figures["own_plan"], "4x0", "1x3"} == set(reading["seconds"])
        assert all(len(s) == 2 and min(s) > 0 for s in reading["seconds"].values())
    assert f"| 3 | {figures['own_plan']} (the engine's) |" in proc.stdout


@pytest.mark.skipif(cpu_kernels() is None, reason="the bf16 GEMV needs AVX512-BF16")
def test_gemv_plans_on_a_model_with_quantized_linears_says_it_has_no_bf16_weights_to_read():
    proc = _lab("gemv_plans", "--model", "smollm2-135m-instruct", "--rows", "1", "--rounds", "1")
    assert proc.returncode != 0
    assert "smollm2-135m-instruct has no bf16 weights for the GEMV (its linears are quantized)" in proc.stderr


def test_linear_rates_times_every_row_each_projection_runs_in_the_mixed_workload(model_dir, tmp_path):
    from bench.workloads import mixed

    out = tmp_path / "linears.json"
    proc = _lab("linear_rates", "--model", model_dir, "--dtype", "float32", "--num-requests", "6",
                "--prompt-range", "8", "40", "--output-range", "2", "12", "--rounds", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    config = json.loads((Path(model_dir) / "config.json").read_text())
    work = mixed(config["vocab_size"], 6, (8, 40), (2, 12))
    rows = {}
    for entry in figures["linears"]:
        rows[entry["linear"]] = rows.get(entry["linear"], 0) + entry["total_rows"]
        assert entry["gflops"] > 0 and entry["warm_gflops"] > 0 and entry["calls"] > 0
    # Every computed token through each layer's qkv_proj once (the last sampled token is never run); one LM-head
    # row per token sampled.
    computed = sum(map(len, work.prompts)) + work.output_tokens - len(work.prompts)
    assert rows["qkv_proj"] == config["num_hidden_layers"] * computed
    assert rows["lm_head"] == work.output_tokens
    assert "| qkv_proj |" in proc.stdout
