"""The last layer's o_proj and MLP run only for the rows whose next token is sampled (`Transformer.forward`'s
`rows`): every row's keys and values are still written, and the sampled rows get what the full forward gives."""

from __future__ import annotations

import torch

from gpu_worker.engine import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [7, 7, 120, 33], [250, 11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


class RowCounting:
    """Calls the kernel it wraps, noting how many rows each call gets."""

    def __init__(self, inner, rows: list[int]):
        self.inner, self.rows = inner, rows

    def __call__(self, x, *args):
        self.rows.append(x.shape[0])
        return self.inner(x, *args)


def _count_down_proj_rows(llm: LLM) -> tuple[list[int], list[int]]:
    first, last = [], []
    layers = llm.engine.runner.model.layers
    for layer, rows in ((layers[0], first), (layers[-1], last)):
        layer.mlp.down_proj.kernel = RowCounting(layer.mlp.down_proj.kernel, rows)
    return first, last


def test_a_prefill_step_runs_the_last_layers_mlp_for_its_sampled_rows_alone(make_checkpoint):
    llm = LLM(str(make_checkpoint("llama")), dtype="float32")
    first, last = _count_down_proj_rows(llm)
    llm.generate(PROMPTS, GREEDY)
    prompt_rows = sum(map(len, PROMPTS))
    assert first == [prompt_rows, 3, 3] and last == [3, 3, 3]  # the prefill step, then two decode steps


def test_prompt_logprobs_keep_every_row_through_the_last_layer(make_checkpoint):
    llm = LLM(str(make_checkpoint("llama")), dtype="float32")
    _, last = _count_down_proj_rows(llm)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    assert last == [len(PROMPTS[0])]
    assert len(out[0].prompt_logprobs) == len(PROMPTS[0])


def test_the_sampled_rows_get_the_full_forwards_hidden_states_and_every_rows_keys_are_written(make_checkpoint):
    llm = LLM(str(make_checkpoint("llama")), dtype="float32")
    engine, runner = llm.engine, llm.engine.runner
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    chunks = sorted(engine.scheduler.schedule().chunks, key=lambda c: c.start)
    ids, positions, metas = runner.prepare(chunks)
    meta = runner.by_layer(metas)
    last_rows = torch.tensor([6, 10, 12])  # each prompt's last row in the step
    with torch.inference_mode():
        for cache in runner.kv_caches:
            cache.zero_()
        sampled = runner.forward(ids, positions, runner.kv_caches, meta, last_rows)
        written = [cache.clone() for cache in runner.kv_caches]
        for cache in runner.kv_caches:
            cache.zero_()
        full = runner.forward(ids, positions, runner.kv_caches, meta)
    torch.testing.assert_close(sampled, full[last_rows], rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(written, runner.kv_caches, strict=True))


def test_chunks_that_sample_nothing_still_fill_the_cache_the_last_one_attends(make_checkpoint):
    path, prompt = str(make_checkpoint("llama")), list(range(3, 60))
    whole = LLM(path, dtype="float32").generate([prompt], GREEDY)[0].outputs[0].token_ids
    chunked = LLM(path, dtype="float32", max_num_batched_tokens=16).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert chunked == whole
