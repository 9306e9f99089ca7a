"""The engines `bench engine` sets against each other, behind one small interface: a `label`, the `workloads` it
runs, and `measure(workload, repeats)` giving tokens/s (a list of `repeats` runs for batch 1, one figure for the
mixed workload). Ours and HF run in this process; vLLM and llama.cpp in their own (`external_peers.py`). Each is
loaded once and kept, so that rounds can alternate between them without reloading anything."""

from __future__ import annotations

import statistics
import time

from . import hf_peer
from .workloads import Workload

BATCH1, MIXED = "batch1", "mixed"


def ours_batch1_tps(llm, work: Workload) -> float:
    from gpu_worker.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=work.output_lens[0], ignore_eos=True)
    engine.add_request("bench-b1", work.prompts[0], params)
    first = None
    while engine.has_unfinished_requests():
        if engine.step() and first is None:
            first = time.perf_counter()
    return (work.output_lens[0] - 1) / (time.perf_counter() - first) if work.output_lens[0] > 1 else 0.0


def ours_mixed(llm, work: Workload) -> dict:
    from gpu_worker.engine import SamplingParams

    engine = llm.engine
    preempted_before = engine.scheduler.num_preemptions
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        engine.add_request(f"bench-m{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    produced, usage = 0, []
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        produced += sum(len(c.token_ids) for out in engine.step() for c in out.outputs)
        usage.append(engine.kv.usage)
    elapsed = time.perf_counter() - started
    return {"tps": produced / elapsed, "kv_usage_peak": max(usage), "kv_usage_mean": statistics.mean(usage),
            "preemptions": engine.scheduler.num_preemptions - preempted_before, "seconds": elapsed}


class Ours:
    label = "tokenfleet"
    workloads = (BATCH1, MIXED)

    def __init__(self, llm, b1: Workload, mix: Workload):
        self.llm, self.b1, self.mix = llm, b1, mix
        self.mixed_runs: list[dict] = []  # KV use and preemptions, reported beside the figures

    def measure(self, workload: str, repeats: int = 1) -> float | list[float]:
        if workload == BATCH1:
            return [ours_batch1_tps(self.llm, self.b1) for _ in range(repeats)]
        self.mixed_runs.append(ours_mixed(self.llm, self.mix))
        return self.mixed_runs[-1]["tps"]


class OursOnAnotherModel(Ours):
    """Our engine on another model, e.g. a mixture of experts' dense twin (the same active parameters): what its
    routing and gathering cost, measured in the same rounds."""

    def __init__(self, llm, model: str, b1: Workload, mix: Workload):
        super().__init__(llm, b1, mix)
        self.label = f"tokenfleet on {model}"

    def close(self) -> None:
        pass


class HfGenerate:
    """transformers' `generate`: batch 1, and the mixed workload in static batches of 16 in arrival order, each
    run to its longest output (only the requested tokens count)."""

    label = "hf-generate"
    workloads = (BATCH1, MIXED)

    def __init__(self, model, b1: Workload, mix: Workload):
        self.model, self.b1, self.mix = model, b1, mix

    def measure(self, workload: str, repeats: int = 1) -> float | list[float]:
        if workload == BATCH1:
            return [hf_peer.batch1_decode_tps(self.model, self.b1) for _ in range(repeats)]
        return hf_peer.static_batches_tps(self.model, self.mix)

    def close(self) -> None:
        pass


class HfContinuousBatching(HfGenerate):
    """transformers' own continuous batching (`generate_batch`), on the mixed workload only."""

    label = "hf-generate_batch"
    workloads = (MIXED,)

    def measure(self, workload: str, repeats: int = 1) -> float:
        return hf_peer.continuous_batching_tps(self.model, self.mix)
