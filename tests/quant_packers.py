"""GPTQ and AWQ 4-bit checkpoint tensors, written the way the public tools write them (for loader tests).

Written from the tools' own code, not from any loader in this repository. Sources, one per fact:

GPTQ (AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda.py `pack`, GPTQModel
gptqmodel/nn_modules/qlinear/__init__.py `pack_block`; read back by vLLM
vllm/model_executor/layers/quantization/gptq.py):
  - qweight int32 [K/8, N]: packed along the input dim K. Nibble j (bits 4j..4j+3) of word [i, n] is input
    row 8i+j of column n. Rows stay in the ORIGINAL input order even with desc_act (AutoGPTQ
    auto_gptq/quantization/gptq.py un-permutes Q with `invperm` before packing).
  - qzeros int32 [K/G, N/8]: packed along the output dim N, same nibble order; scales fp16 [K/G, N];
    g_idx int32 [K] = the group of each input row.
  - dequant (w as [K, N], the transpose of torch's Linear weight): w[k, n] = s[g, n] * (q[k, n] - z[g, n]),
    g = g_idx[k]. Classic format ("checkpoint_format": "gptq"): the stored nibble is z - 1, and readers
    add 1 back after masking (`zeros = zeros + 1` in AutoGPTQ qlinear_cuda.py, `zeros[i] + 1` in vLLM's
    gptq_gemm). "gptq_v2": the stored nibble is z itself (GPTQModel convert_gptq_v1_to_v2_format; vLLM's
    `use_v2_format`, zero_offset 0).
  - So the classic format can hold z = 1..16 only: a stored 15 reads back as 16, never 0. The tools do not
    agree on what z = 0 becomes: AutoGPTQ computes `zeros -= 1` then casts to uint32, so -1 sets the nibble
    AND every higher nibble of that word to 15; GPTQModel subtracts 0x11111111 from the whole word, so the
    nibble becomes 15 and the borrow takes 1 from the next nibble. pack_gptq therefore refuses z = 0 when
    v2=False instead of picking one wrong answer.
  - desc_act=True (AutoGPTQ gptq.py `fasterquant`, static_groups=False): columns are quantized in the order
    perm = argsort(diag(H), descending) and grouped in that order, then g_idx = (arange(K) // G)[invperm],
    i.e. g_idx[k] = (position of k in perm) // G: not monotonic.
  - RTN with 0 inside the range, zero = round(-xmin / scale), sym zero = (maxq + 1) / 2 = 8 (AutoGPTQ
    auto_gptq/quantization/quantizer.py `find_params`).

AWQ GEMM (AutoAWQ awq/modules/linear/gemm.py `WQLinear_GEMM.from_linear`; read back by
awq/utils/packing_utils.py `dequantize_gemm` and vLLM vllm/model_executor/layers/quantization/awq_triton.py):
  - qweight int32 [K, N/8]: packed along the OUTPUT dim N. Word [k, c] covers columns 8c..8c+7, and nibble i
    holds column 8c + AWQ_ORDER[i], AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7] (`order_map` when packing).
    Readers invert it with AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]: column 8c+m sits in nibble
    AWQ_REVERSE_ORDER[m] (packing_utils.py; awq_triton.py builds the same list as `reverse_awq_order_tensor`).
  - qzeros int32 [K/G, N/8], same interleave, the zero stored as is (no -1); scales fp16 [K/G, N]; no g_idx.
    w = s * (q - z).

quantization_config field names: GPTQModel QuantizeConfig.to_dict (bits, group_size, desc_act, sym, lm_head,
quant_method, checkpoint_format, ...); AutoAWQ awq/models/_config.py `to_transformers_dict` (quant_method,
zero_point, group_size, bits, version lowercased, modules_to_not_convert).
"""

from __future__ import annotations

import torch

MAXQ = 15  # 4 bits
PACK = 8  # 4-bit values per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8


def _group_of(K: int, group_size: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    if g_idx is None:
        if K % group_size:
            raise ValueError(f"K={K} is not a multiple of group_size={group_size}")
        return torch.arange(K) // group_size
    if g_idx.shape != (K,):
        raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, expected ({K},)")
    return g_idx.long()


def quantize_groupwise(w: torch.Tensor, group_size: int, g_idx: torch.Tensor | None = None,
                       sym: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantization of a Linear weight w [N, K], per (output row, group of inputs).

    Returns q uint8 [N, K] (0..15), scales float32 [N, num_groups] (values exactly representable in fp16,
    as they will be stored), zeros int32 [N, num_groups] (0..15) with w ~ scales[n, g] * (q - zeros[n, g]),
    g = k // group_size or g_idx[k]. Asymmetric: min/max with 0 inside the range, zero = round(-min/scale);
    sym=True: scale = 2 * max|w| / 15 and zero 8.
    """
    N, K = w.shape
    groups = _group_of(K, group_size, g_idx)
    num_groups = K // group_size
    w = w.float()
    scales = torch.empty(N, num_groups)
    zeros = torch.empty(N, num_groups, dtype=torch.int32)
    for g in range(num_groups):
        wg = w[:, groups == g]
        if wg.shape[1] == 0:
            raise ValueError(f"group {g} has no input rows")
        xmin = wg.min(dim=1).values.clamp(max=0)
        xmax = wg.max(dim=1).values.clamp(min=0)
        if sym:
            xmax = torch.maximum(-xmin, xmax)
            xmin = -xmax
        empty = xmax == xmin  # an all-zero row: any scale works
        xmin, xmax = torch.where(empty, -1.0, xmin), torch.where(empty, 1.0, xmax)
        scale = ((xmax - xmin) / MAXQ).half().float()
        scales[:, g] = scale
        zeros[:, g] = 8 if sym else torch.round(-xmin / scale).clamp(0, MAXQ).to(torch.int32)
    s, z = scales[:, groups], zeros[:, groups].float()
    q = torch.clamp(torch.round(w / s) + z, 0, MAXQ).to(torch.uint8)
    return q, scales, zeros


def dequantize_groupwise(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                         g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [N, K]: scales[n, g(k)] * (q[n, k] - zeros[n, g(k)])."""
    groups = _group_of(q.shape[1], group_size, g_idx)
    return scales.float()[:, groups] * (q.float() - zeros.float()[:, groups])


def act_order_g_idx(K: int, group_size: int, generator: torch.Generator) -> torch.Tensor:
    """int32 [K] as desc_act=True writes it: g_idx[k] = (position of k in a random permutation) // group_size."""
    if K % group_size:
        raise ValueError(f"K={K} is not a multiple of group_size={group_size}")
    perm = torch.randperm(K, generator=generator)  # stands in for argsort(diag(H), descending=True)
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[perm] = (torch.arange(K) // group_size).to(torch.int32)
    return g_idx


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 [...]: nibble i (low bits first) = nibbles[..., i], two's complement."""
    if nibbles.shape[-1] != PACK:
        raise ValueError("need 8 nibbles per word")
    n = nibbles.long()
    if n.min() < 0 or n.max() > MAXQ:
        raise ValueError("4-bit values must be in 0..15")
    word = (n << (4 * torch.arange(PACK))).sum(dim=-1)  # 0 .. 2**32 - 1
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _check_shapes(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> None:
    N, K = q.shape
    if N % PACK or K % PACK:
        raise ValueError(f"N={N} and K={K} must be multiples of {PACK}")
    if K % group_size or scales.shape != (N, K // group_size) or zeros.shape != scales.shape:
        raise ValueError(f"scales/zeros must be [N, K/group_size] = [{N}, {K // max(group_size, 1)}]")


def pack_gptq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              g_idx: torch.Tensor | None = None, v2: bool = False) -> dict[str, torch.Tensor]:
    """GPTQ tensors of one Linear from quantize_groupwise's output (q [N, K], scales/zeros [N, G]).

    v2=False writes the classic format (stored zero = z - 1; z must be 1..16); v2=True writes gptq_v2
    (stored zero = z; z must be 0..15).
    """
    _check_shapes(q, scales, zeros, group_size)
    N, K = q.shape
    groups = _group_of(K, group_size, g_idx)
    z = zeros.long().T  # [G, N]
    if v2:
        if z.min() < 0 or z.max() > MAXQ:
            raise ValueError("gptq_v2 zero points must be 0..15")
    else:
        if z.min() < 1 or z.max() > MAXQ + 1:
            raise ValueError("the classic GPTQ format stores z - 1 in 4 bits, so zero points must be 1..16 "
                             "(z = 0 is not representable; use v2=True)")
        z = z - 1
    qk = q.long().T.reshape(K // PACK, PACK, N)  # [K/8, 8 input rows, N]
    return {
        "qweight": _words(qk.permute(0, 2, 1)),  # [K/8, N]
        "qzeros": _words(z.reshape(K // group_size, N // PACK, PACK)),  # [G, N/8]
        "scales": scales.T.contiguous().to(torch.float16),  # [G, N]
        "g_idx": groups.to(torch.int32),  # [K]
    }


def pack_awq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AWQ GEMM tensors of one Linear from quantize_groupwise's output (no g_idx: groups are k // group_size)."""
    _check_shapes(q, scales, zeros, group_size)
    N, K = q.shape
    order = list(AWQ_ORDER)
    qn = q.long().T.reshape(K, N // PACK, PACK)[:, :, order]  # nibble i <- column 8c + AWQ_ORDER[i]
    zn = zeros.long().T.reshape(K // group_size, N // PACK, PACK)[:, :, order]
    return {
        "qweight": _words(qn),  # [K, N/8]
        "qzeros": _words(zn),  # [G, N/8]
        "scales": scales.T.contiguous().to(torch.float16),  # [G, N]
    }


def gptq_quantization_config(group_size: int = 128, desc_act: bool = False, v2: bool = False,
                             sym: bool = True) -> dict:
    """config.json's quantization_config as GPTQModel/AutoGPTQ write it. `sym` must match how the weights
    were quantized (sym=True: every zero is 8); a sym=False checkpoint is only exact in readers that use
    qzeros (vLLM's Marlin path assumes zero 8 for sym=True)."""
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": "gptq_v2" if v2 else "gptq", "lm_head": False, "damp_percent": 0.01,
            "static_groups": False, "true_sequential": True}


def awq_quantization_config(group_size: int = 128) -> dict:
    """config.json's quantization_config as AutoAWQ's to_transformers_dict writes it (GEMM kernels)."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}
