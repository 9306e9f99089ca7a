"""The host family that names a benchmark's result file, from /proc/cpuinfo's text or a GPU's device name, and the
file a run writes by default."""

from __future__ import annotations

import argparse

import pytest

from bench import host, report
from bench.host import cpu_family_of, gpu_family_of


def cpuinfo(vendor: str, family: int, model: int, flags: str, cpus: int = 2) -> str:
    """/proc/cpuinfo's text for `cpus` identical CPUs, the fields the family is read from among others."""
    one = (f"processor\t: {{n}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
           f"model name\t: some CPU\nflags\t\t: fpu sse2 {flags}\n")
    return "\n".join(one.format(n=n) for n in range(cpus))


AVX512 = "avx2 fma avx512f avx512_bf16 avx512_vnni"


@pytest.mark.parametrize(("vendor", "family", "model", "flags", "expected"), [
    ("AuthenticAMD", 25, 0x01, "avx2 fma", "zen3"),  # Milan
    ("AuthenticAMD", 25, 0x21, "avx2 fma", "zen3"),  # Vermeer
    ("AuthenticAMD", 25, 0x44, "avx2 fma", "zen3"),  # Rembrandt (Zen 3+)
    ("AuthenticAMD", 25, 0x11, AVX512, "zen4"),  # Genoa
    ("AuthenticAMD", 25, 0x61, AVX512, "zen4"),  # Raphael
    ("AuthenticAMD", 25, 0x74, AVX512, "zen4"),  # Phoenix
    ("AuthenticAMD", 25, 0xA0, AVX512, "zen4"),  # Bergamo
    ("AuthenticAMD", 26, 0x02, AVX512, "zen5"),  # Turin
    ("AuthenticAMD", 23, 0x31, "avx2 fma", "avx2"),  # Zen 2: no family of its own
    ("GenuineIntel", 6, 0x8F, AVX512 + " amx_bf16 amx_tile amx_int8", "xeon-amx"),  # Sapphire Rapids
    ("GenuineIntel", 6, 0x6A, "avx2 fma avx512f avx512_vnni", "xeon-avx512"),  # Ice Lake
    ("GenuineIntel", 6, 0x97, "avx2 fma avx_vnni", "avx2"),  # Alder Lake
    ("GenuineIntel", 6, 0x1A, "sse4_2", "cpu"),
])
def test_the_cpu_family_comes_from_vendor_family_model_and_flags(vendor, family, model, flags, expected):
    assert cpu_family_of(cpuinfo(vendor, family, model, flags)) == expected


def test_the_first_cpu_decides_and_unreadable_text_is_a_plain_cpu():
    text = cpuinfo("AuthenticAMD", 25, 0x11, AVX512, cpus=1) + "\n" + cpuinfo("GenuineIntel", 6, 0x8F, "amx_tile")
    assert cpu_family_of(text) == "zen4"
    assert cpu_family_of("") == "cpu"
    assert cpu_family_of("cpu family\t: unknown\nflags\t: avx2") == "avx2"


@pytest.mark.parametrize(("name", "expected"), [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L4", "l4"), ("Tesla T4", "t4"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"), ("AMD Instinct MI300X", "mi300x"), ("Mystery Accelerator", "gpu"),
])
def test_a_gpu_is_named_by_its_model(name, expected):
    assert gpu_family_of(name) == expected


def test_a_run_writes_to_its_benchmarks_file_for_this_host_family_unless_told_where(monkeypatch, tmp_path):
    monkeypatch.setattr(host, "host_family", lambda: "zen4")
    parser = argparse.ArgumentParser()
    report.add_output_argument(parser, "semantic-cache")
    assert report.output_path(parser.parse_args([])) == report.RESULTS / "semantic-cache-zen4.json"
    assert report.RESULTS.parts[-2:] == ("bench", "results")
    given = tmp_path / "mine.json"
    assert report.output_path(parser.parse_args(["--json", str(given)])) == given
