"""Bad input gets a clear error naming what is wrong, and the engine keeps serving everyone else."""

from __future__ import annotations

import pytest

from gpu_worker.engine import LLM, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(make_checkpoint):
    return LLM(str(make_checkpoint("llama")), dtype="float32", max_model_len=256)


def _serve_one_good_request_alongside(llm: LLM, bad_call) -> None:
    engine = llm.engine
    engine.add_request("good", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    with pytest.raises(InvalidRequestError) as err:
        bad_call(engine)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    return err.value


def test_empty_prompt_is_refused(llm):
    err = _serve_one_good_request_alongside(llm, lambda e: e.add_request("bad", [], SamplingParams()))
    assert err.param == "prompt" and "empty" in str(err)


def test_empty_string_prompt_is_refused(llm):
    err = _serve_one_good_request_alongside(llm, lambda e: e.add_request("bad", "", SamplingParams()))
    assert err.param == "prompt"


def test_prompt_longer_than_the_context_is_refused(llm):
    err = _serve_one_good_request_alongside(llm, lambda e: e.add_request("bad", [1] * 300, SamplingParams()))
    assert err.param == "prompt" and "256" in str(err)


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    err = _serve_one_good_request_alongside(llm, lambda e: e.add_request("bad", [10**7], SamplingParams()))
    assert err.param == "prompt"


def test_duplicate_request_id_is_refused(llm):
    err = _serve_one_good_request_alongside(llm, lambda e: e.add_request("good", [1, 2], SamplingParams()))
    assert err.param == "request_id"


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 2.0),
    ("n", 0), ("presence_penalty", 3.0), ("logprobs", 100), ("repetition_penalty", 0.0),
    ("repetition_penalty", float("inf")), ("temperature", float("inf")), ("top_p", float("nan")),
    ("frequency_penalty", float("nan")), ("top_k", 2**63),
])
def test_out_of_range_sampling_fields_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


def test_generate_with_one_bad_prompt_runs_none(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2, 3], []], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
