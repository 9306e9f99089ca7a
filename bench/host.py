"""What a benchmark ran on, printed beside its figures: the CPU, the instruction sets our kernels choose by, the
L3, the CPUs the process may use, and the read bandwidth, measured whenever asked (on a shared VM it drifts by
2x within minutes, so a figure is only ever compared with readings taken around it)."""

from __future__ import annotations

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


def avx2_host_flags(flags: frozenset[str]) -> frozenset[str]:
    """Of a CPU's flags, those a host with AVX2 and FMA but no AVX-512, AMX or AVX-VNNI (a Zen 3) would show."""
    return frozenset(f for f in flags if not f.startswith(("avx512", "amx", "avx_vnni")))


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
