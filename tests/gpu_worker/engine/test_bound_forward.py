"""The model runner's forward (`Transformer.bound`): the modules' calls bound ahead of time, computing what the
modules compute and following the kernels and attention an engine or a test installs after it was built."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine import LLM, SamplingParams
from gpu_worker.engine.kernels import cpu_has_avx512_bf16

PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [7, 7, 120, 33], [250, 11]]


class Recording:
    """Calls what it wraps and counts the calls."""

    def __init__(self, inner, calls: list):
        self.inner, self.calls = inner, calls

    def __call__(self, *args):
        self.calls.append(1)
        return self.inner(*args)


def _one_step_both_ways(llm: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    """A scheduled step's hidden states through the modules and through the runner's bound forward."""
    engine, runner = llm.engine, llm.engine.runner
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prompts' prefill: the next step decodes every request
    out = engine.scheduler.schedule()
    ids, positions, metas = runner.prepare(sorted(out.chunks, key=lambda c: c.start))
    with torch.inference_mode():
        return (runner.model(ids, positions, runner.kv_caches, runner.by_layer(metas)),
                runner.forward(ids, positions, runner.kv_caches, runner.by_layer(metas)))


@pytest.mark.parametrize("dtype", [
    "float32",
    pytest.param("bfloat16", marks=pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="native bf16 kernels")),
])
def test_the_bound_forward_gives_the_modules_bits(make_checkpoint, dtype):
    modules, bound = _one_step_both_ways(LLM(str(make_checkpoint("llama")), dtype=dtype))
    assert torch.equal(modules, bound)


def test_an_attention_installed_after_the_engine_was_built_serves_its_steps(make_checkpoint):
    llm = LLM(str(make_checkpoint("llama")), dtype="float32")
    layers, calls = llm.engine.runner.model.layers, []
    for layer in layers:
        layer.self_attn.attn = Recording(layer.self_attn.attn, calls)
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(calls) == 3 * len(layers)  # the prefill step and two decode steps, every layer


def test_a_linear_kernel_swapped_after_the_engine_was_built_serves_its_steps(make_checkpoint):
    llm = LLM(str(make_checkpoint("llama")), dtype="float32")
    down, calls = llm.engine.runner.model.layers[-1].mlp.down_proj, []
    down.kernel = Recording(down.kernel, calls)
    llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(calls) == 2


def test_module_hooks_run_only_while_the_runner_steps_through_the_modules(make_checkpoint):
    llm = LLM(str(make_checkpoint("llama")), dtype="float32")
    runner, seen = llm.engine.runner, []
    hook = runner.model.layers[0].mlp.gate_up_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([PROMPTS[0]], params)
    assert not seen  # the bound forward calls no module
    with runner.through_modules():
        llm.generate([PROMPTS[0]], params)
    hook.remove()
    assert [len(x) for x in seen] == [len(PROMPTS[0]), 1]  # the prompt's rows, then the decode step's one
