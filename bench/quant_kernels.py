"""Quantized linear kernels on one device: each against the dequantizing reference (max error) and bf16
`F.linear` (time, and the weight bytes it streams per second), shapes of a Llama layer and LM head.

    python -m bench.quant_kernels [--device cuda] [--rows 1,16,128] [--shapes 4096x4096,14336x4096]

The variants of a shape run interleaved in rounds, and each time is the median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from gpu_worker.engine.quantization.kernels import DequantLinearKernel, quantized_linear_kernel
from gpu_worker.engine.quantization.methods import WeightQuantizer


def _time(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def run(device: torch.device, shapes: list[tuple[int, int]], rows: list[int], methods: list[str],
        rounds: int) -> list[dict]:
    out = []
    for n, k in shapes:
        w = torch.randn(n, k, device=device) / k**0.5
        dense = w.to(torch.bfloat16)
        kernels = {"bf16": (lambda x, d=dense: F.linear(x, d), dense.nbytes)}
        for method in methods:
            try:
                weight = WeightQuantizer(method)(w)
            except (RuntimeError, TypeError) as exc:  # e.g. no float8 on this build
                print(f"{method} {n}x{k}: {exc}")
                continue
            kernel = quantized_linear_kernel(weight, torch.bfloat16, device)
            kernels[f"{method} ({type(kernel).__name__})"] = (
                lambda x, kn=kernel: kn(x, None, None), weight.nbytes, DequantLinearKernel(weight))
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            times = {name: [] for name in kernels}
            for _ in range(rounds):
                for name, (fn, *_rest) in kernels.items():
                    fn(x)  # warm-up within the round: caches as the engine would find them
                    times[name].append(_time(lambda f=fn, a=x: f(a), device))
            for name, (fn, nbytes, *ref) in kernels.items():
                seconds = statistics.median(times[name])
                error = ((fn(x).float() - ref[0](x.float(), None, None)).abs().max().item() if ref else 0.0)
                out.append({"shape": f"{n}x{k}", "rows": m, "kernel": name, "ms": seconds * 1e3,
                            "gb_s": nbytes / seconds / 1e9, "max_error": error})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shapes", default="4096x4096,14336x4096,128256x4096")
    p.add_argument("--rows", default="1,16,128")
    p.add_argument("--methods", default="int8,int4,fp8")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    device = torch.device(args.device)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    print("| shape | rows | kernel | ms | weight GB/s | max abs error vs reference |")
    print("|---|---:|---|---:|---:|---:|")
    for r in run(device, shapes, rows, args.methods.split(","), args.rounds):
        print(f"| {r['shape']} | {r['rows']} | {r['kernel']} | {r['ms']:.3f} | {r['gb_s']:.1f} "
              f"| {r['max_error']:.3g} |")


if __name__ == "__main__":
    main()
