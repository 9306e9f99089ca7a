"""`tokenfleet bench avx2`: an AVX2-only host's kernel choices on this CPU, native against the torch path, in a
process of its own (it changes how that process sees the CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpu_worker.engine.kernels import AVX2_FLAGS, cpu_has


@pytest.mark.skipif(not cpu_has(AVX2_FLAGS), reason="the CPU has no AVX2")
def test_bench_avx2_runs_the_native_kernels_against_the_torch_path_with_an_avx2_hosts_choices(tmp_path):
    out = tmp_path / "avx2.json"
    subprocess.run([sys.executable, "-m", "services.cli", "bench", "avx2", "--model", "tokenfleet-small",
                    "--rounds", "2", "--num-requests", "4", "--json", str(out)], check=True, timeout=600)
    result = json.loads(out.read_text())
    assert "ISA avx2 fma," in result["native"]
    assert "CpuPagedAttention" in result["native"] and "WidenedDecodeAttention" in result["torch"]
    assert "WidenedBf16LinearKernel" in result["native"] and "avx512" not in result["native"]
    assert len(result["rounds"]) == 2
    for workload in ("batch 1", "mixed"):
        figures = result["summary"][workload]
        assert figures["native"] > 0 and figures["torch"] > 0
        assert figures["ratio_min"] <= figures["ratio"] <= figures["ratio_max"]
