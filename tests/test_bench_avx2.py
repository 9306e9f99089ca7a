"""`tokenfleet bench avx2`: an AVX2-only host's kernel choices on this CPU, native against the torch path, in a
process of its own (it changes how that process sees the CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.external_peers import llamacpp_cmake_args
from bench.host import avx2_host_flags
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


def test_its_llama_cpp_peer_is_built_for_an_avx2_hosts_instruction_sets_alone():
    zen4 = frozenset({"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16"})
    options = set(llamacpp_cmake_args(avx2_host_flags(zen4)).split())
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"} <= options
    assert {"-DGGML_AVX512=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX_VNNI=OFF"} <= options
