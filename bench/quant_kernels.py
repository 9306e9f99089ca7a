"""Quantized linear kernels on one device: each against the dequantizing reference (max error) and the engine's
bf16 linear (time, and the weight bytes it streams per second; on CPU the prepacked oneDNN matmul where the CPU
packs bf16), shapes of a Llama layer and LM head; with
`--attention`, paged decode attention over a bf16 and an int8 KV cache (the bytes of context it reads per second).

    python -m bench.quant_kernels [--device cuda] [--rows 1,16,128] [--shapes 4096x4096,14336x4096] [--attention]

The variants of a shape run interleaved in rounds, and each time is the median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu_worker.engine.linear import OneDnnPackedLinearKernel, TorchLinearKernel
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
        bf16 = OneDnnPackedLinearKernel(dense) if OneDnnPackedLinearKernel.supports(dense) else TorchLinearKernel()
        kernels = {"bf16": (lambda x, d=dense, kn=bf16: kn(x, d, None), dense.nbytes)}
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


def attention(device: torch.device, rounds: int, batch: int = 32, context: int = 4096, heads: int = 32,
              kv_heads: int = 8, head_dim: int = 128, block_size: int = 16) -> list[dict]:
    """Decode attention of `batch` sequences of `context` tokens (Llama-3-8B's heads) over each cache format,
    through the kernels the engine installs on this device, against the bf16 reference's output."""
    from gpu_worker.engine.attention import AttentionMetadata, HeadLayout, TorchPagedAttention
    from gpu_worker.engine.kv_cache_format import DenseKVFormat, ScaledKVFormat, quantize_per_row

    blocks_per_seq = context // block_size
    tables = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq).tolist()
    meta = AttentionMetadata.decode_rows(tables, [context] * batch, block_size, device)
    dense = torch.randn(2, batch * blocks_per_seq, kv_heads, block_size, head_dim, device=device,
                        dtype=torch.bfloat16)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16)
    layout = HeadLayout(heads, kv_heads, head_dim, head_dim**-0.5)
    reference = TorchPagedAttention(layout).decode(q.float(), dense.float(), meta)
    out = []
    for fmt in (DenseKVFormat(torch.bfloat16), ScaledKVFormat("int8", torch.bfloat16)):
        model = _OneLayer(layout)
        fmt.install(model, device)
        attn = model.layers[0].self_attn.attn
        cache = dense
        if fmt.name == "int8":
            cache = fmt.allocate(1, dense.shape[1], block_size, kv_heads, head_dim, device)[0]
            cache.data[:], cache.scale[:] = quantize_per_row(dense)
        seconds = statistics.median(_time(lambda a=attn, c=cache: a.decode(q, c, meta), device)
                                    for _ in range(rounds))
        # Bytes of context read: bf16 values, or int8 values and a bf16 scale per token and head.
        read = dense.numel() * 2 if fmt.name != "int8" else dense.numel() + dense[..., 0].numel() * 2
        error = (attn.decode(q, cache, meta).float() - reference).abs().max().item()
        out.append({"kv cache": fmt.name, "kernel": type(attn).__name__, "ms": seconds * 1e3,
                    "gb_s": read / seconds / 1e9, "max_error": error})
    return out


class _OneLayer:
    """What `KVCacheFormat.install` reads of a model: its config's head_dim and each layer's attention."""

    def __init__(self, layout):
        from types import SimpleNamespace

        from gpu_worker.engine.attention import TorchPagedAttention

        self.config = SimpleNamespace(head_dim=layout.head_dim)
        self.layers = [SimpleNamespace(self_attn=SimpleNamespace(attn=TorchPagedAttention(layout)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shapes", default="4096x4096,14336x4096,128256x4096")
    p.add_argument("--rows", default="1,16,128")
    p.add_argument("--methods", default="int8,int4,fp8")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--attention", action="store_true", help="also decode attention over bf16 and int8 KV caches")
    args = p.parse_args()
    device = torch.device(args.device)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    print("| shape | rows | kernel | ms | weight GB/s | max abs error vs reference |")
    print("|---|---:|---|---:|---:|---:|")
    for r in run(device, shapes, rows, args.methods.split(","), args.rounds):
        print(f"| {r['shape']} | {r['rows']} | {r['kernel']} | {r['ms']:.3f} | {r['gb_s']:.1f} "
              f"| {r['max_error']:.3g} |")
    if args.attention:
        print("\n| decode attention, 32 x 4096 tokens | kernel | ms | context GB/s | max abs error vs bf16 reference |")
        print("|---|---|---:|---:|---:|")
        for r in attention(device, args.rounds):
            print(f"| {r['kv cache']} | {r['kernel']} | {r['ms']:.3f} | {r['gb_s']:.1f} | {r['max_error']:.3g} |")


if __name__ == "__main__":
    main()
