"""Batch-1 decode with the weights on transparent huge pages (as the engine loads them on CPU) against the same
engine with copies of them on ordinary pages: one engine per mode, its weight tensors switched between the two
copies before each run, the two placements interleaved in rounds (two engines side by side differed by up to
1.25x by which was created first, whatever their weights' pages).

    python -m bench.huge_pages [--modes bf16,int8,int4] [--rounds 8] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from gpu_worker.engine.linear import Linear

from .contestants import ours_batch1_tps
from .quant import mode_configuration
from .report import spread
from .workloads import batch1

# The tensors a decode step streams, by where they live: a linear's dense weight, a quantized kernel's matrix.
_STREAMED = ("weight", "q", "packed")


def _streamed(model: torch.nn.Module) -> list[tuple[object, str, torch.Tensor]]:
    found = []
    for module in model.modules():
        if isinstance(module, Linear):
            for holder in (module, module.kernel):
                for name in _STREAMED:
                    value = getattr(holder, name, None)
                    if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_mkldnn:
                        found.append((holder, name, value))
    return found


class Placements:
    """Each streamed tensor's huge-page original and an ordinary-page copy, swapped in by `use`."""

    def __init__(self, model: torch.nn.Module):
        self.tensors = [(holder, name, value, value.clone()) for holder, name, value in _streamed(model)]

    def use(self, huge: bool) -> None:
        for holder, name, original, copy in self.tensors:
            chosen = original if huge else copy
            if isinstance(holder, torch.nn.Module) and name in holder._parameters:
                holder._parameters[name] = torch.nn.Parameter(chosen, requires_grad=False)
            else:
                setattr(holder, name, chosen)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--modes", default="bf16,int8,int4")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args(argv)
    from gpu_worker.engine import LLM

    engines = {}
    for mode in args.modes.split(","):
        config = mode_configuration(mode, args.model)
        llm = LLM(config.model, **config.engine_options())
        engines[mode] = (llm, Placements(llm.engine.runner.model))
        ours_batch1_tps(llm, batch1(llm.engine.model_config.vocab_size, 16, 4, seed=1))  # warm-up
    runs = {(mode, huge): [] for mode in engines for huge in (True, False)}
    for r in range(args.rounds):
        for mode, (llm, placements) in engines.items():
            for huge in ((True, False) if r % 2 == 0 else (False, True)):
                placements.use(huge)
                runs[mode, huge].append(ours_batch1_tps(llm, batch1(llm.engine.model_config.vocab_size)))
            placements.use(True)
    print(f"batch-1 decode tok/s, {args.model}, {torch.get_num_threads()} threads, {args.rounds} rounds (median)")
    print("| mode | huge pages | ordinary pages | ratio, median [min, max] |")
    print("|---|---:|---:|---:|")
    for mode in engines:
        huge, plain = runs[mode, True], runs[mode, False]
        ratios = [a / b for a, b in zip(huge, plain, strict=True)]
        print(f"| {mode} | {statistics.median(huge):.1f} | {statistics.median(plain):.1f} | {spread(ratios)} |")


if __name__ == "__main__":
    main()
