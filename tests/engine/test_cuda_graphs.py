"""Which batch sizes get a CUDA graph (the graph runner itself: tests/engine/test_triton_engine.py on CPU,
tests/engine/test_cuda.py on a GPU)."""

from gpu_worker.engine.cuda_graphs import batch_buckets


def test_buckets_double_up_to_max_num_seqs_and_end_at_it():
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_buckets(1) == [1]
