"""The GPTQ/AWQ checkpoint writer in tests/quant_packers.py, checked against hand-computed words and an
unpacker written here with plain bit loops (reading the words the way vLLM's gptq.py / awq_triton.py do)."""

from __future__ import annotations

import pytest
import torch

from tests.quant_packers import (
    act_order_g_idx,
    awq_quantization_config,
    dequantize_groupwise,
    gptq_quantization_config,
    pack_awq,
    pack_gptq,
    quantize_groupwise,
)

# vLLM awq_triton.py: column 8c+m of an AWQ word sits in nibble AWQ_REVERSE_ORDER[m].
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def nibble(word: int, i: int) -> int:
    return ((word & 0xFFFFFFFF) >> (4 * i)) & 0xF


def unpack_gptq(packed: dict, v2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> q [N, K] and the zero points z [N, G] a reader uses (stored nibble + 1 unless v2)."""
    qweight, qzeros = packed["qweight"].tolist(), packed["qzeros"].tolist()
    K, N = 8 * len(qweight), len(qweight[0])
    q = torch.zeros(N, K, dtype=torch.long)
    for i in range(K // 8):
        for n in range(N):
            for j in range(8):
                q[n, 8 * i + j] = nibble(qweight[i][n], j)
    z = torch.zeros(N, len(qzeros), dtype=torch.long)
    for g, row in enumerate(qzeros):
        for c, word in enumerate(row):
            for j in range(8):
                z[8 * c + j, g] = nibble(word, j) + (0 if v2 else 1)
    return q, z


def unpack_awq(packed: dict) -> tuple[torch.Tensor, torch.Tensor]:
    qweight, qzeros = packed["qweight"].tolist(), packed["qzeros"].tolist()
    K, N = len(qweight), 8 * len(qweight[0])
    q = torch.zeros(N, K, dtype=torch.long)
    z = torch.zeros(N, len(qzeros), dtype=torch.long)
    for words, out in ((qweight, q), (qzeros, z)):  # row r of the words is input row / group r
        for r, row in enumerate(words):
            for c, word in enumerate(row):
                for m in range(8):
                    out[8 * c + m, r] = nibble(word, AWQ_REVERSE_ORDER[m])
    return q, z


def tiny(values_of_column) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K=8, N=8, one group: q[n, k] = values_of_column(n)[k], scales 0.5, zeros 8."""
    q = torch.tensor([values_of_column(n) for n in range(8)], dtype=torch.uint8)
    return q, torch.full((8, 1), 0.5), torch.full((8, 1), 8, dtype=torch.int32)


def test_gptq_qweight_word_by_hand():
    # Column n holds q[n, k] = k + n + 1 (mod 16). Word [0, n] packs input rows 0..7, row 0 in the low nibble:
    # n=0: nibbles 1,2,...,8 -> 0x87654321 = 2271560481 -> int32 2271560481 - 2**32 = -2023406815
    # n=1: nibbles 2,...,9   -> 0x98765432 = 2557891634 -> int32 -1737075662
    # n=7: nibbles 8,...,15  -> 0xFEDCBA98 = 4275878552 -> int32 -19088744
    q, s, z = tiny(lambda n: [(k + n + 1) % 16 for k in range(8)])
    packed = pack_gptq(q, s, z, group_size=8)
    assert packed["qweight"].shape == (1, 8) and packed["qweight"].dtype == torch.int32
    assert packed["qweight"][0, 0].item() == -2023406815
    assert packed["qweight"][0, 1].item() == -1737075662
    assert packed["qweight"][0, 7].item() == -19088744


def test_gptq_zero_minus_one_by_hand():
    q, s, _ = tiny(lambda n: [0] * 8)
    z = torch.arange(1, 9, dtype=torch.int32).view(8, 1)  # column n has zero n + 1
    # classic: stored n -> nibbles 0..7 along N -> 0x76543210 = 1985229328
    assert pack_gptq(q, s, z, group_size=8)["qzeros"].tolist() == [[1985229328]]
    # gptq_v2: stored n + 1 -> 0x87654321 -> -2023406815
    assert pack_gptq(q, s, z, group_size=8, v2=True)["qzeros"].tolist() == [[-2023406815]]
    # classic holds 1..16: z = 16 is stored as 15 (0x76543F10 with column 2 -> 16) ...
    z16 = z.clone()
    z16[2, 0] = 16
    assert pack_gptq(q, s, z16, group_size=8)["qzeros"].tolist() == [[0x76543F10]]
    # ... and z = 0 has no classic encoding
    z[0, 0] = 0
    with pytest.raises(ValueError, match="1..16"):
        pack_gptq(q, s, z, group_size=8)
    assert pack_gptq(q, s, z, group_size=8, v2=True)["qzeros"].tolist() == [[0x87654320 - 2**32]]


def test_awq_words_by_hand():
    # Row k=0 holds q[n, 0] = n. Nibble i holds column AWQ_ORDER[i] = 0,2,4,6,1,3,5,7, so the nibbles from low
    # to high are 0,2,4,6,1,3,5,7 -> 0x75316420 = 1966171168.
    q, s, _ = tiny(lambda n: [n] * 8)
    z = torch.arange(8, 16, dtype=torch.int32).view(8, 1)  # zeros 8..15, stored as is
    packed = pack_awq(q, s, z, group_size=8)
    assert packed["qweight"].shape == (8, 1) and packed["qzeros"].shape == (1, 1)
    assert packed["qweight"][:, 0].tolist() == [1966171168] * 8
    # zeros: nibbles 8,10,12,14,9,11,13,15 -> 0xFDB9ECA8 = 4256820392 -> int32 -38146904
    assert packed["qzeros"].tolist() == [[-38146904]]
    assert packed["scales"].dtype == torch.float16 and packed["scales"].shape == (1, 8)
    assert set(packed) == {"qweight", "qzeros", "scales"}


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_round_trip(desc_act, v2):
    gen = torch.Generator().manual_seed(3)
    N, K, G = 24, 64, 16
    w = torch.randn(N, K, generator=gen)
    g_idx = act_order_g_idx(K, G, gen) if desc_act else None
    q, s, z = quantize_groupwise(w, G, g_idx)
    packed = pack_gptq(q, s, z, G, g_idx, v2=v2)
    assert {k: tuple(v.shape) for k, v in packed.items()} == {
        "qweight": (K // 8, N), "qzeros": (K // G, N // 8), "scales": (K // G, N), "g_idx": (K,)}
    assert packed["scales"].dtype == torch.float16 and packed["g_idx"].dtype == torch.int32
    uq, uz = unpack_gptq(packed, v2)
    assert torch.equal(uq, q.long()) and torch.equal(uz, z.long())
    groups = packed["g_idx"].long() if desc_act else torch.arange(K) // G
    assert torch.equal(packed["g_idx"].long(), groups)
    # a reader's dequantization, as [K, N]: s[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])
    s16 = packed["scales"].float()
    w_kn = s16[groups] * (uq.T - uz.T[groups]).float()
    assert torch.equal(w_kn.T, dequantize_groupwise(q, s, z, G, g_idx))


def test_act_order_g_idx_is_a_permutation_of_groups():
    g_idx = act_order_g_idx(64, 16, torch.Generator().manual_seed(0))
    assert g_idx.dtype == torch.int32
    assert torch.equal(torch.bincount(g_idx.long()), torch.full((4,), 16))
    assert not torch.equal(g_idx, torch.arange(64, dtype=torch.int32) // 16)  # not monotonic


def test_awq_round_trip():
    gen = torch.Generator().manual_seed(5)
    N, K, G = 32, 48, 16
    q, s, z = quantize_groupwise(torch.randn(N, K, generator=gen), G)
    packed = pack_awq(q, s, z, G)
    uq, uz = unpack_awq(packed)
    assert torch.equal(uq, q.long()) and torch.equal(uz, z.long())
    assert torch.equal(packed["scales"].float().T, s)


@pytest.mark.parametrize("sym", [False, True])
def test_quantize_groupwise_is_close(sym):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 64, generator=gen)
    g_idx = act_order_g_idx(64, 16, gen)
    q, s, z = quantize_groupwise(w, 16, g_idx, sym=sym)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert s.dtype == torch.float32 and torch.equal(s, s.half().float())
    assert int(z.min()) >= 0 and int(z.max()) <= 15
    if sym:
        assert torch.all(z == 8)
    err = (w - dequantize_groupwise(q, s, z, 16, g_idx)).abs()
    assert torch.all(err <= 0.55 * s[:, g_idx.long()])
    assert torch.equal(q, quantize_groupwise(w, 16, g_idx, sym=sym)[0])  # deterministic


def test_configs():
    assert gptq_quantization_config(desc_act=True, v2=True) == {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True,
        "checkpoint_format": "gptq_v2", "lm_head": False, "damp_percent": 0.01, "static_groups": False,
        "true_sequential": True}
    assert gptq_quantization_config()["checkpoint_format"] == "gptq"
    assert awq_quantization_config(64) == {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                           "version": "gemm", "modules_to_not_convert": None}
