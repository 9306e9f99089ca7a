"""What the kernel tests share: the native bf16 modules this CPU can run, seeded weights, decode rows over shuffled
block tables, and the products the matmul kernels are held to."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine.attention import AttentionMetadata, PrefillChunk
from gpu_worker.engine.kernels import AVX2_FLAGS, avx2_kernels, cpu_has, cpu_has_avx512_bf16, cpu_kernels

# The native bf16 modules this CPU can run, for a test to take each: AVX-512's (it needs AVX512-BF16) and AVX2's
# (the element-wise ops from one source at two vector widths, decode attention on bf16 and int8 caches).
NATIVE_BUILDS = [
    pytest.param(cpu_kernels, id="avx512",
                 marks=pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the native kernels need AVX512-BF16")),
    pytest.param(avx2_kernels, id="avx2", marks=pytest.mark.skipif(not cpu_has(AVX2_FLAGS), reason="no AVX2")),
]


def decode_metadata(context_lens: list[int], num_blocks: int, block_size: int) -> AttentionMetadata:
    """One decode row per context length, each through its own shuffled blocks of a pool of `num_blocks`."""
    gen = torch.Generator().manual_seed(len(context_lens))
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for length in context_lens:
        need = -(-length // block_size)
        tables.append(blocks[:need])
        blocks = blocks[need:]
    return AttentionMetadata.decode_rows(tables, context_lens, block_size)


def mixed_step(decode_lens: list[int], chunks: list[tuple[int, int]], kv_cache: torch.Tensor,
               num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step of decode rows (one per context length) then prefill chunks ((query_len, context_len): the last
    query_len tokens of the context), each sequence through its own shuffled blocks of the cache [2, blocks, KVH,
    block_size, D]. Returns q [T, H, D] and this step's k, v [T, KVH, D], read from the cache where the step's
    KV write put them, and the metadata."""
    num_blocks, kv_heads, block_size, head_dim = kv_cache.shape[1:]
    meta = decode_metadata(decode_lens, num_blocks, block_size)
    used = {b for row in meta.decode_block_tables.tolist() for b in row}
    free = [b for b in torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7)).tolist() if b not in used]
    positions = [(table, length - 1) for table, length in zip(meta.decode_block_tables.tolist(), decode_lens,
                                                               strict=True)]
    start = len(decode_lens)
    for query_len, context_len in chunks:
        need = -(-context_len // block_size)
        table, free = free[:need], free[need:]
        meta.prefills.append(PrefillChunk(start, query_len, context_len, torch.tensor(table)))
        positions += [(table, p) for p in range(context_len - query_len, context_len)]
        start += query_len
    blocks = torch.tensor([table[p // block_size] for table, p in positions])
    offsets = torch.tensor([p % block_size for _, p in positions])
    k, v = (kv_cache[i][blocks, :, offsets] for i in range(2))
    q = torch.randn(len(positions), num_heads, head_dim).to(kv_cache.dtype)
    return q, k, v, AttentionMetadata(blocks, offsets, block_size, meta.decode_context_list,
                                      meta.decode_block_tables, meta.decode_context_lens, meta.prefills)


def free_out_of_window(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """Sets to -1, as the KV manager frees them, the block-table entries of blocks wholly before the first key a
    sliding window of `window` tokens lets each decode row (its last `window` positions) and each prefill chunk (its
    first row's) see. Returns `meta`, changed in place."""
    block_size = meta.block_size
    for row, length in enumerate(meta.decode_context_list):
        meta.decode_block_tables[row, : max(0, length - window) // block_size] = -1
    for chunk in meta.prefills:
        chunk.block_table[: chunk.first_key(window) // block_size] = -1
    return meta


def poisoned(cache: torch.Tensor) -> torch.Tensor:
    """A copy of the cache [2, blocks, KVH, block_size, D] in a buffer with NaN where a kernel that read a freed entry
    (-1) would land: a block's worth before the keys, and one more block at the end of each plane (the values'
    block -1 is the keys' last), which no block table lists. Reading either makes its output NaN."""
    two, blocks, *rest = cache.shape
    block = cache[0, 0].numel()
    buffer = torch.full((block + two * (blocks + 1) * block,), float("nan"), dtype=cache.dtype, device=cache.device)
    out = buffer[block:].view(two, blocks + 1, *rest)
    out[:, :blocks] = cache
    return out


def poisoned_int8(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`poisoned` for an int8 cache's planes: its scales NaN there (int8 has no NaN), data [2, blocks, KVH,
    block_size, D] and scale [2, blocks, KVH, block_size]."""
    two, blocks, *rest = data.shape
    block = data[0, 0].numel()
    buffer = torch.zeros(block + two * (blocks + 1) * block, dtype=data.dtype, device=data.device)
    new_data = buffer[block:].view(two, blocks + 1, *rest)
    new_data[:, :blocks] = data
    new_data[:, blocks] = 127
    return new_data, poisoned(scale[..., None])[..., 0]


def seeded_weight(n: int, k: int) -> torch.Tensor:
    """An [n, k] float32 weight, the same for the same shape in every test, of a trained layer's magnitude."""
    torch.manual_seed(n * 7919 + k)
    return torch.randn(n, k) * 0.05


def assert_is_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """`got` against x @ w.T (+ bias) in float64, x as the kernel saw it: fp32 summation error only in float32;
    within bf16's rounding of the output in bfloat16."""
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0])
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w.double().abs().T  # sum |x w|: what fp32 summation error scales with
    tol = 1e-5 * scale + 1e-6
    if x.dtype == torch.bfloat16:
        tol += 2 ** -8 * want.abs()  # rounding the output: half an ulp of bf16 (2^-9 relative), with margin
    err = (got.double() - want).abs()
    assert (err <= tol).all(), f"max error {err.max().item():.3g} (tolerance there {tol.flatten()[err.argmax()]:.3g})"


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels quantize it: per run of 32, scale max |x| / 127, q = round-half-even(x * 127 / max)."""
    runs = x.float().unflatten(-1, (-1, 32))
    peak = runs.abs().amax(-1, keepdim=True)
    # torch.full_like(...) / peak, not 127 / peak: Python's reflected division is reciprocal(peak) * 127, an ulp
    # off at times, which moves ties (x = max / 2 in bf16) to the other side.
    inverse = torch.where(peak > 0, torch.full_like(peak, 127) / peak, torch.zeros_like(peak))
    return ((runs * inverse).round() * (peak / 127)).flatten(-2)


def assert_is_product_with_quantized_x(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """What the int8-activation kernels compute: the weight times x quantized per run of 32, up to fp32 summation
    (and bf16's rounding of the output)."""
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0])
    xq = quantized_x(x).double()
    want = xq @ w.double().T
    tol = 1e-5 * (xq.abs() @ w.double().abs().T) + 1e-6
    if x.dtype == torch.bfloat16:
        tol += 2 ** -8 * want.abs()
    err = (got.double() - want).abs()
    assert (err <= tol).all(), f"max error {err.max().item():.3g} (tolerance there {tol.flatten()[err.argmax()]:.3g})"
