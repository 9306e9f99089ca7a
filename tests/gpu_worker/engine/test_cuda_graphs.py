"""The CUDA path's host-side pieces, on CPU: which batch sizes get a CUDA graph (the graph runner itself:
tests/gpu_worker/engine/test_triton_engine.py here, tests/gpu_worker/engine/test_cuda.py on a GPU), and the step
memory_profile measures before sizing the KV pool."""

import torch

from gpu_worker.engine import LLM
from gpu_worker.engine.cuda_graphs import batch_buckets
from gpu_worker.engine.memory_profile import largest_step


def test_buckets_double_up_to_max_num_seqs_and_end_at_it():
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_buckets(1) == [1]


def test_the_profiled_step_runs_a_full_token_budget_in_chunks_of_max_model_len(make_checkpoint):
    """What memory_profile measures on CUDA: here it must run, over several chunks, into its own cache."""
    engine = LLM(str(make_checkpoint("llama")), dtype="float32", kv_cache_memory_bytes=8 << 20).engine
    model = engine.runner.model
    caches, run = largest_step(model, engine.kv_format, 16, 300, 128, 64, torch.device("cpu"))
    assert caches[0].shape[1] == 8 + 8 + 3  # blocks of chunks of 128, 128 and 44 tokens
    run()
    assert all(cache.abs().sum() > 0 for cache in caches)
