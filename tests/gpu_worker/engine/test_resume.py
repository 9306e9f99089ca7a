"""A request resumed from the tokens another engine already produced continues exactly (worker failover)."""

import pytest

from gpu_worker.engine import LLM, ResumedChoice, SamplingParams


@pytest.fixture(scope="module")
def llm(make_checkpoint):
    return LLM(model=str(make_checkpoint("llama")), dtype="float32", kv_cache_memory_bytes=64 << 20)


def _run(llm, prompt, params, resume=None):
    engine = llm.engine
    engine.add_request("r", prompt, params, resume=resume)
    texts, tokens = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                texts[c.index] = texts.get(c.index, "") + c.text
                tokens.setdefault(c.index, []).extend(c.token_ids)
    assert engine.kv.pool.num_used == 0
    return texts, tokens


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=24, ignore_eos=True),
], ids=["greedy", "seeded-n2"])
def test_resumed_request_continues_with_the_tokens_and_text_of_an_uninterrupted_run(llm, params):
    prompt = list(range(5, 45))
    full_text, full_tokens = _run(llm, prompt, params)
    cut = 9
    emitted = {i: len(llm.engine.tokenizer.decode(full_tokens[i][:cut])) // 2 for i in full_tokens}
    resume = [ResumedChoice(i, full_tokens[i][:cut], emitted[i]) for i in sorted(full_tokens)]
    rest_text, rest_tokens = _run(llm, prompt, params, resume)
    for i in full_tokens:
        assert full_tokens[i][:cut] + rest_tokens[i] == full_tokens[i]
        assert full_text[i][:emitted[i]] + rest_text[i] == full_text[i]


def test_resume_runs_only_the_unfinished_choices(llm):
    params = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=10, ignore_eos=True)
    _, full_tokens = _run(llm, [7, 8, 9], params)
    _, rest = _run(llm, [7, 8, 9], params, [ResumedChoice(2, full_tokens[2][:4], 0)])
    assert list(rest) == [2] and full_tokens[2][:4] + rest[2] == full_tokens[2]
