"""The HF transformers peer: `generate` (batch 1 and static batches) and its continuous-batching manager."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .workloads import Workload


def load(model_path, dtype: torch.dtype | str):
    """An HF model directory, or a .gguf file (transformers dequantizes its weights to `dtype`)."""
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def left_padded(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) with left padding, as HF wants for generation."""
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def _generate(model, batch: list[list[int]], new_tokens: int) -> None:
    ids, mask = (t.to(model.device) for t in left_padded(batch))
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, pad_token_id=0)


def batch1_decode_tps(model, work: Workload) -> float:
    """Decode tokens/s: (n - 1) tokens over the time beyond the first token (prefill)."""
    prompt, n = work.prompts[0], work.output_lens[0]
    _generate(model, [prompt], 2)  # warm-up
    started = time.perf_counter()
    _generate(model, [prompt], 1)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    _generate(model, [prompt], n)
    return (n - 1) / (time.perf_counter() - started - prefill)


def static_batches_tps(model, work: Workload, batch_size: int = 16) -> float:
    """Useful output tokens/s with static batches in arrival order: each runs to its longest output."""
    started = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        _generate(model, work.prompts[i:i + batch_size], max(work.output_lens[i:i + batch_size]))
    return work.output_tokens / (time.perf_counter() - started)


def continuous_batching_tps(model, work: Workload) -> float:
    """transformers' own continuous batching (`init_continuous_batching`), per-request output lengths."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(work.output_lens), eos_token_id=-1,
                              pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        started = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(work.prompts, work.output_lens,
                                                                         strict=True)]
        # Results come back in completion order; asking for one id can skip (and lose) the others.
        pending, produced = set(ids), 0
        while pending:
            result = manager.get_result(timeout=600)
            if result is None:
                raise TimeoutError(f"{len(pending)} requests unfinished after 600 s")
            if result.request_id in pending:
                pending.discard(result.request_id)
                produced += len(result.generated_tokens)
        elapsed = time.perf_counter() - started
    finally:
        manager.stop(block=True)
    return produced / elapsed
