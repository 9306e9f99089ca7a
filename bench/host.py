"""What a benchmark ran on, printed beside its figures: the CPU, the instruction sets our kernels choose by, the
L3, the CPUs the process may use, and the read bandwidth, measured whenever asked (on a shared VM it drifts by
2x within minutes, so a figure is only ever compared with readings taken around it); and the host's family, which
names its result files."""

from __future__ import annotations

import functools
import os
import statistics
import time
from pathlib import Path

import torch

from gpu_worker.engine.kernels import cpu_isa, cpu_model


def l3_bytes() -> int | None:
    """The L3 of the first CPU, from sysfs (None where it does not say)."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "3":
                size = (index / "size").read_text().strip()
                return int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0)
        except (OSError, ValueError):
            continue
    return None



# AMD family 19h models that are Zen 4 (Genoa and Bergamo, Raphael, Phoenix); the rest of 19h is Zen 3. 1Ah: Zen 5.
ZEN4_MODELS = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))
GPU_BRANDS = {"nvidia", "geforce", "tesla", "quadro", "amd", "instinct", "radeon"}


def cpu_family_of(cpuinfo: str) -> str:
    """A result file's name for a CPU, from /proc/cpuinfo's text (its first CPU): zen3, zen4, zen5, xeon-amx,
    xeon-avx512, avx2 or cpu. Figures are compared within a family: the kernels chosen and the memory differ
    between them."""
    first = cpuinfo.split("\n\n")[0]
    fields = dict((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in first.splitlines()))
    vendor, flags = fields.get("vendor_id"), set(fields.get("flags", "").split())
    family, model = (int(fields[k]) if fields.get(k, "").isdigit() else 0 for k in ("cpu family", "model"))
    if vendor == "AuthenticAMD" and family == 0x19:
        return "zen4" if any(model in models for models in ZEN4_MODELS) else "zen3"
    if vendor == "AuthenticAMD" and family == 0x1A:
        return "zen5"
    if vendor == "GenuineIntel" and "amx_tile" in flags:
        return "xeon-amx"
    if vendor == "GenuineIntel" and "avx512f" in flags:
        return "xeon-avx512"
    return "avx2" if "avx2" in flags else "cpu"


def gpu_family_of(device_name: str) -> str:
    """A GPU's short name from its device name: "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA A100-SXM4-80GB" -> a100,
    "NVIDIA GeForce RTX 4090" -> rtx4090 (the words up to the first with a digit, brands left out)."""
    words = [w for w in device_name.replace("-", " ").split() if w.lower() not in GPU_BRANDS]
    last = next((i for i, w in enumerate(words) if any(c.isdigit() for c in w)), None)
    return "gpu" if last is None else "".join(words[:last + 1]).lower()


@functools.cache
def host_family() -> str:
    """This host's family: its GPU's short name where torch sees one, else its CPU's."""
    if torch.cuda.is_available():
        return gpu_family_of(torch.cuda.get_device_name())
    try:
        return cpu_family_of(Path("/proc/cpuinfo").read_text())
    except OSError:
        return "cpu"


def describe() -> dict:
    return {"cpu": cpu_model(), "isa": cpu_isa(), "l3_bytes": l3_bytes(),
            "cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}


def read_bandwidth_gbs(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """GB/s of a `sum` over `nbytes` of float32, median of `repeats` (the first pass faults the pages in). On CUDA
    4 GiB timed by events: 1 GiB is read in a quarter of a millisecond, and a launch and a sync would be a tenth."""
    if nbytes is None:
        nbytes = 4 << 30 if device.type == "cuda" else 1 << 30
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            x.sum()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            x.sum().item()
            times.append(time.perf_counter() - started)
    return x.numel() * 4 / statistics.median(times) / 1e9


def describe_line(host: dict, weight_bytes: int) -> str:
    l3 = host["l3_bytes"]
    where = ("" if l3 is None else
             f"; weights read per token {weight_bytes / 1e6:.0f} MB "
             f"{'fit in' if weight_bytes < l3 else 'exceed'} the L3 ({l3 / (1 << 20):.0f} MiB)")
    return (f"host: {host['cpu']}, ISA {' '.join(host['isa']) or 'baseline'}, CPUs {host['cpus']}, "
            f"{host['threads']} threads{where}")


def between_bandwidth_readings(measure, device: torch.device):
    """(mean read bandwidth just before and just after `measure()`, its result)."""
    before = read_bandwidth_gbs(device)
    value = measure()
    return (before + read_bandwidth_gbs(device)) / 2, value
