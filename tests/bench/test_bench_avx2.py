"""`python -m bench.lab.avx2_path`: an AVX2-only host's kernel choices on this CPU, native against the torch path,
chosen through `EngineConfig` (`cpu_isa="avx2"`, `torch_ops=True`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.external_peers import llamacpp_cmake_args
from gpu_worker.engine.kernel_choice import avx2_host_flags
from gpu_worker.engine.kernels import AVX2_FLAGS, cpu_has

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not cpu_has(AVX2_FLAGS), reason="the CPU has no AVX2")
def test_the_avx2_path_runs_the_native_kernels_against_the_torch_path_with_an_avx2_hosts_choices(tmp_path,
                                                                                               make_checkpoint):
    out = tmp_path / "avx2.json"
    model = make_checkpoint("llama", torch.bfloat16, hidden_size=128, num_attention_heads=2)  # heads of 64
    subprocess.run([sys.executable, "-m", "bench.lab.avx2_path", "--model", str(model), "--rounds", "2",
                    "--num-requests", "2", "--json", str(out)], check=True, timeout=600, cwd=REPO)
    result = json.loads(out.read_text())
    assert "ISA avx2 fma," in result["native"] and "native bf16 kernels tokenfleet_avx2_kernels" in result["native"]
    assert "CpuPagedAttention" in result["native"] and "WidenedDecodeAttention" in result["torch"]
    assert "WidenedBf16LinearKernel" in result["native"] and "avx512" not in result["native"]
    assert "WidenedBf16LinearKernel" in result["torch"] and "native bf16 kernels none" in result["torch"]
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
