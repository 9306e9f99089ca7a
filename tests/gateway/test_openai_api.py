"""The gateway speaks OpenAI's API: the real `openai` client against the running stack."""

from __future__ import annotations

import json

import httpx
import pytest

from gpu_worker.engine import SamplingParams
from services.base import protocol as p
from tests.stack import API_KEY, MODEL

MESSAGES = [{"role": "user", "content": "Tell me about paged attention."}]


def _chat_ids(llm, messages):
    return llm.engine.tokenizer.apply_chat_template(messages)


def test_greedy_chat_equals_the_engine_run_directly_and_usage_counts_its_tokens(stack, reference_llm):
    reply = stack.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    ids = _chat_ids(reference_llm, MESSAGES)
    want = reference_llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=24))[0]
    assert reply.choices[0].message.content == want.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == want.finish_reason
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == len(want.token_ids)
    assert reply.usage.total_tokens == len(ids) + len(want.token_ids)
    assert reply.model == MODEL and reply.id.startswith("chatcmpl-")


def test_streamed_greedy_completion_joins_to_the_engine_text(stack, reference_llm):
    prompt = "The quick brown fox"
    chunks = list(stack.client().completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                    stream=True))
    want = reference_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20))[0]
    assert all(c.choices for c in chunks), "without include_usage every chunk has a choice, as OpenAI's"
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason


def test_streamed_chat_with_include_usage_ends_with_a_usage_chunk_without_choices(stack, reference_llm):
    chunks = list(stack.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == len(_chat_ids(reference_llm, MESSAGES))
    assert all(c.usage is None for c in body)
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == reference_llm.generate(
        [_chat_ids(reference_llm, MESSAGES)], SamplingParams(temperature=0.0, max_tokens=12))[0].text


def test_sse_stream_is_data_lines_ending_with_done(stack):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert all("choices" in json.loads(line[6:]) for line in lines[:-1])


def test_n_2_returns_two_choices_counted_in_usage(stack):
    reply = stack.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, n=2,
                                                   temperature=1.0, seed=11)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content != reply.choices[1].message.content
    assert reply.usage.completion_tokens == 20


def test_seeded_sampling_is_reproducible_and_equals_the_engine(stack, reference_llm):
    client = stack.client()
    runs = [client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.9,
                                      top_p=0.95, seed=1234).choices[0].text for _ in range(2)]
    want = reference_llm.generate(["Once upon a time"],
                                  SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16))[0]
    assert runs[0] == runs[1] == want.text


def test_stop_string_ends_the_text_before_it(stack, reference_llm):
    full = reference_llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=30))[0].text
    stop = full[8:11]
    reply = stack.client().completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=30,
                                              temperature=0, stop=[stop])
    assert reply.choices[0].text == full[:full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_chat_logprobs_carry_the_sampled_token_and_its_top_alternatives(stack):
    reply = stack.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                                   logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))


def test_auto_routes_a_short_request_to_the_small_tier_and_records_why(stack):
    reply = stack.client().chat.completions.create(model="auto", messages=MESSAGES, max_tokens=8)
    assert reply.model == MODEL
    event = next(e for e in p.completion_events(stack.redis().xrange(p.EVENTS_STREAM))
                 if e.request_id == reply.id.removeprefix("chatcmpl-"))
    assert event.routing.model == MODEL and event.routing.reason.startswith("auto:")
    assert event.usage.completion_tokens == reply.usage.completion_tokens


def test_null_fields_mean_their_defaults(stack):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": None, "top_p": None, "n": None,
            "stop": None, "seed": None, "logprobs": None, "stream": None, "presence_penalty": None}
    response = httpx.post(stack.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_models_lists_the_served_model_and_auto(stack):
    ids = [m.id for m in stack.client().models.list()]
    assert MODEL in ids and "auto" in ids


def test_every_response_carries_a_request_id(stack):
    for response in (httpx.get(stack.url + "/healthz"), httpx.get(stack.url + "/v1/models")):
        assert len(response.headers["x-request-id"]) == 32


def test_readyz_reports_live_workers_and_metrics_are_prometheus_text(stack):
    ready = httpx.get(stack.url + "/readyz").json()
    assert ready["status"] == "ready" and ready["workers"][MODEL] >= 1
    metrics = httpx.get(stack.url + "/metrics")
    assert "tokenfleet_gateway_requests_total" in metrics.text


def test_a_repeated_long_prompt_reports_its_cached_tokens(stack):
    messages = [{"role": "system", "content": "You answer briefly. " * 40}, {"role": "user", "content": "Hi"}]
    client = stack.client()
    # Two workers, no prefix-aware routing yet: by the third request some worker has seen the prompt.
    replies = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2) for _ in range(3)]
    assert replies[0].usage.prompt_tokens_details.cached_tokens == 0
    assert 64 <= replies[2].usage.prompt_tokens_details.cached_tokens < replies[2].usage.prompt_tokens


def test_cache_salt_keeps_prefix_cache_hits_within_the_salt(stack):
    messages = [{"role": "system", "content": "Salted prompt for one tenant. " * 30}, {"role": "user", "content": "Hi"}]
    client = stack.client()

    def cached(salt: str) -> int:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                               extra_body={"cache_salt": salt})
        return reply.usage.prompt_tokens_details.cached_tokens

    assert [cached("tenant-a") for _ in range(3)][2] >= 64  # by the third, a worker has seen it (two workers)
    assert cached("tenant-b") == 0
