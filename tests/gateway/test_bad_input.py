"""Input no handler can use is a 400 (413 for size) with OpenAI's error object naming the field, answered
before anything is queued or tokenized, and the client's keep-alive connection goes on serving it."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.stack import API_KEY, MODEL

HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
MESSAGES = '[{"role": "user", "content": "hi"}]'
DEEP = "[" * 1000 + "]" * 1000

# (raw JSON body, the param the error names)
CASES = {
    "infinity": (f'{{"model": "{MODEL}", "messages": {MESSAGES}, "repetition_penalty": Infinity}}',
                 "repetition_penalty"),
    "nan": (f'{{"model": "{MODEL}", "messages": {MESSAGES}, "temperature": NaN}}', "temperature"),
    "overflowing-float": (f'{{"model": "{MODEL}", "messages": {MESSAGES}, "top_p": 1e999}}', "top_p"),
    "lone-surrogate": (f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "\\ud800"}}]}}',
                       "messages.0.content"),
    "text-part-not-a-string": (f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": '
                               f'[{{"type": "text", "text": 5}}]}}]}}', "messages.0.content"),
    "deep-nesting": (f'{{"model": "{MODEL}", "messages": {MESSAGES}, "user": {DEEP}}}', None),
    "huge-integer": (f'{{"model": "{MODEL}", "messages": {MESSAGES}, "max_tokens": {"9" * 5000}}}', "max_tokens"),
    "top-k-2-63": (f'{{"model": "{MODEL}", "messages": {MESSAGES}, "top_k": {2**63}}}', "top_k"),
    "seed-2-64": (f'{{"model": "{MODEL}", "messages": {MESSAGES}, "seed": {2**64}}}', "seed"),
    "long-cache-salt": (f'{{"model": "{MODEL}", "messages": {MESSAGES}, "cache_salt": "{"s" * 1000}"}}',
                        "cache_salt"),
}


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.url, headers=HEADERS, timeout=60) as client:
        yield client


@pytest.mark.parametrize("case", CASES)
def test_unusable_input_is_a_400_naming_the_field_and_the_connection_stays_usable(client, case):
    body, param = CASES[case]
    response = client.post("/v1/chat/completions", content=body.encode("utf-8", "surrogatepass"))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if param is None:
        assert "nests deeper" in error["message"]
    ok = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 2})
    assert ok.status_code == 200


def test_an_oversized_body_is_refused_413_at_once_while_the_model_keeps_serving(stack, client):
    huge = b'{"model": "%s", "messages": [{"role": "user", "content": "%s"}]}' % (MODEL.encode(), b"x" * (10 << 20))
    started = time.perf_counter()
    response = httpx.post(stack.url + "/v1/chat/completions", content=huge, headers=HEADERS, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert time.perf_counter() - started < 5
    ok = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 2})
    assert ok.status_code == 200


def test_a_chunked_body_without_a_length_is_cut_off_at_the_limit(stack):
    def chunks():
        yield b'{"model": "%s", "messages": [{"role": "user", "content": "' % MODEL.encode()
        for _ in range(10):
            yield b"x" * (1 << 20)
        yield b'"}]}'

    response = httpx.post(stack.url + "/v1/chat/completions", content=chunks(), headers=HEADERS, timeout=60)
    assert response.status_code == 413


def test_oversized_headers_are_refused_431_with_an_openai_error(stack, client):
    response = httpx.post(stack.url + "/v1/chat/completions", timeout=60,
                          headers={**HEADERS, "X-Padding": "p" * (12 << 10)},
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert response.status_code == 431
    assert response.json()["error"]["code"] == "request_header_fields_too_large"
