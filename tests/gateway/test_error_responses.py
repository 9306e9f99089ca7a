"""Bad requests get OpenAI's error object with the right status, and nothing else is disturbed."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from services.base import protocol as p
from tests.stack import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(stack, body, headers=AUTH, path="/v1/chat/completions", **kwargs) -> httpx.Response:
    return httpx.post(stack.url + path, headers=headers, timeout=60, **kwargs,
                      **({} if "content" in kwargs else {"json": body}))


def _error(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer not-a-key"}], ids=["no-key", "bad-key"])
def test_missing_or_wrong_key_is_401(stack, headers):
    response = _post(stack, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, headers=headers)
    assert response.status_code == 401 and _error(response)["code"] == "invalid_api_key"


def test_malformed_json_is_400(stack):
    response = _post(stack, None, content=b"{not json", headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 400 and "JSON" in _error(response)["message"]


@pytest.mark.parametrize(("field", "value"), [("temperature", 5), ("top_p", 0), ("max_tokens", 0), ("n", 0),
                                              ("stop", ["a", "b", "c", "d", "e"]), ("presence_penalty", 3)])
def test_out_of_range_field_is_400_naming_it(stack, field, value):
    response = _post(stack, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: value})
    assert response.status_code == 400 and _error(response)["param"] == field


def test_unsupported_field_is_400_naming_it(stack):
    response = _post(stack, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert response.status_code == 400 and _error(response)["param"] == "tools"


def test_unknown_model_is_404(stack):
    with pytest.raises(openai.NotFoundError) as err:
        stack.client().chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_the_context_is_400(stack, stream):
    with pytest.raises(openai.BadRequestError) as err:
        stack.client().completions.create(model=MODEL, prompt="word " * 3000, max_tokens=5, stream=stream)
    assert err.value.body["param"] == "prompt"


def _fill_queue(stack, count: int, started: threading.Barrier) -> list[threading.Thread]:
    def long_request():
        client = stack.client(stack.small_queue_url, max_retries=0)
        stream = client.completions.create(model=MODEL, prompt="Go", max_tokens=300, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        started.wait()
        for _ in stream:
            pass

    threads = [threading.Thread(target=long_request) for _ in range(count)]
    for t in threads:
        t.start()
    return threads


def test_a_full_queue_answers_429_with_retry_after_and_the_client_retry_then_succeeds(stack):
    started = threading.Barrier(3)
    threads = _fill_queue(stack, 2, started)
    started.wait(timeout=60)
    response = httpx.post(stack.small_queue_url + "/v1/completions", headers=AUTH, timeout=60,
                          json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
    assert _error(response)["type"] == "rate_limit_error"
    reply = stack.client(stack.small_queue_url, max_retries=20).completions.create(model=MODEL, prompt="Hi",
                                                                                   max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
    for t in threads:
        t.join(60)


def test_other_requests_are_served_while_bad_ones_fail(stack):
    bad = _post(stack, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1})
    good = stack.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3)
    assert bad.status_code == 400 and good.usage.completion_tokens == 3


def test_a_model_whose_workers_are_all_gone_answers_503_with_retry_after(stack):
    info = p.ModelInfo(name="ghost", model_dir="/nowhere", max_model_len=2048)
    stack.redis().hset(p.MODELS_KEY, info.name, info.model_dump_json())  # registered once, no live worker now
    try:
        response = _post(stack, {"model": "ghost", "messages": [{"role": "user", "content": "hi"}]})
    finally:
        stack.redis().hdel(p.MODELS_KEY, info.name)
    assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
    assert _error(response)["code"] == "no_worker"
