"""Request bodies are validated strictly, as OpenAI's: a value of the wrong JSON type is a 400 naming the field,
never coerced ("yes" or 1 for true, "5" for 5), and a message's content is null only where OpenAI allows it, in
an assistant message that carries tool calls."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.test_bad_input import HEADERS
from tests.stack import MODEL

USER = {"role": "user", "content": "hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.url, headers=HEADERS, timeout=60) as client:
        yield client


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [USER], "max_tokens": 2, **fields}


def _assert_refused(client, body: dict, param: str) -> None:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def _assert_accepted(client, body: dict) -> None:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("fields", "param"), [
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
], ids=["string", "int", "nested-string"])
def test_a_bool_field_refuses_a_string_and_an_int(client, fields, param):
    _assert_refused(client, _chat(**fields), param)


@pytest.mark.parametrize("value", ["2", 2.5, True], ids=["string", "fraction", "bool"])
def test_an_int_field_refuses_a_string_a_fraction_and_a_bool(client, value):
    _assert_refused(client, _chat(max_tokens=value), "max_tokens")


def test_an_int_field_takes_a_whole_number_float_as_json_schema_does(client):
    _assert_accepted(client, _chat(max_tokens=2.0))


@pytest.mark.parametrize("value", ["0.5", True], ids=["string", "bool"])
def test_a_float_field_refuses_a_string_and_a_bool(client, value):
    _assert_refused(client, _chat(temperature=value), "temperature")


def test_a_float_field_takes_an_int(client):
    _assert_accepted(client, _chat(temperature=0))


def test_a_string_field_refuses_a_number(client):
    _assert_refused(client, _chat(user=5), "user")


def test_the_messages_list_refuses_a_string(client):
    _assert_refused(client, _chat(messages="hi"), "messages")


def test_an_object_field_refuses_a_list(client):
    _assert_refused(client, _chat(stream_options=[{"include_usage": True}]), "stream_options")


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "user", "content": None}], "messages.0.content"),
    ([{"role": "user"}], "messages.0.content"),
    ([{"role": "system", "content": None}, USER], "messages.0.content"),
    ([{"role": "developer", "content": None}, USER], "messages.0.content"),
    ([USER, {"role": "assistant", "content": None}, USER], "messages.1.content"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": []}, USER], "messages.1.content"),
    ([USER, {"role": "tool", "content": None, "tool_call_id": "call_1"}], "messages.1.content"),
], ids=["user", "user-without-content", "system", "developer", "assistant", "assistant-with-no-tool-calls", "tool"])
def test_null_content_is_refused_naming_the_message(client, messages, param):
    _assert_refused(client, _chat(messages=messages), param)


@pytest.mark.parametrize("call", [{"content": None, "tool_calls": [CALL]}, {"function_call": CALL["function"]}],
                         ids=["tool_calls", "legacy-function_call"])
def test_an_assistant_message_that_carries_tool_calls_may_have_no_content(client, call):
    messages = [USER, {"role": "assistant", **call}, {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    _assert_accepted(client, _chat(messages=messages))
