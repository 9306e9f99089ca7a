"""The response caches end to end, through the gateway with the real `openai` client: a hit comes back by
the normal response path (whole or streamed), marked in the `x-tokenfleet-cache` header and in the
completion event; misses for any difference; per tenant; opt-in per request or per API key."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.stack import MODEL

pytestmark = pytest.mark.usefixtures("stack")


def _ask(client: openai.OpenAI, content: str, **kwargs):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **{"max_tokens": 8, "temperature": 0,
                                                                          **kwargs})
    return raw.headers.get("x-tokenfleet-cache"), raw.parse()


def _unique(text: str) -> str:
    return f"{text} (case {uuid.uuid4().hex[:8]})"


def test_an_identical_deterministic_request_is_answered_from_the_exact_cache(stack):
    client, question = stack.client(), _unique("Name three primary colors.")
    first_mark, first = _ask(client, question, extra_body={"cache": "exact"})
    second_mark, second = _ask(client, question, extra_body={"cache": "exact"})
    assert (first_mark, second_mark) == ("miss", "exact")
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.completion_tokens == first.usage.completion_tokens
    event = stack.completion_event(second.id)
    assert event.routing.cache == "exact" and event.worker_id == "response-cache"
    assert stack.completion_event(first.id).routing.cache == "miss"


@pytest.mark.parametrize("change", [{"max_tokens": 7}, {"temperature": 0.5, "seed": 1}, {"top_p": 0.9},
                                    {"stop": ["zz"]}, {"presence_penalty": 0.1}])
def test_a_request_differing_in_any_sampling_field_misses(stack, change):
    client, question = stack.client(), _unique("What is a prime number?")
    _ask(client, question, extra_body={"cache": "exact"})
    mark, _ = _ask(client, question, extra_body={"cache": "exact"}, **change)
    assert mark == "miss"


def test_a_sampled_request_without_a_seed_is_never_cached(stack):
    client, question = stack.client(), _unique("Tell me a story.")
    _ask(client, question, temperature=1.0, extra_body={"cache": "exact"})
    mark, _ = _ask(client, question, temperature=1.0, extra_body={"cache": "exact"})
    assert mark == "miss"


def test_a_hit_streams_like_a_generated_response(stack):
    client, question = stack.client(), _unique("Count to five.")
    _, first = _ask(client, question, extra_body={"cache": "exact"})
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache": "exact"})
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert raw.headers["x-tokenfleet-cache"] == "exact"
    assert text == first.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens


def test_another_tenant_never_receives_a_tenants_entry(stack):
    question = _unique("Summarize our Q3 plan.")
    tenant_a, tenant_b = stack.key_client("tenant-a"), stack.key_client("tenant-b")
    _ask(tenant_a, question, extra_body={"cache": "exact"})
    assert _ask(tenant_a, question, extra_body={"cache": "exact"})[0] == "exact"
    assert _ask(tenant_b, question, extra_body={"cache": "exact"})[0] == "miss"


def test_the_cache_is_off_unless_the_request_or_its_key_asks(stack):
    question = _unique("Define entropy.")
    client = stack.client()
    _ask(client, question)
    assert _ask(client, question)[0] is None  # neither asked: no lookup, no mark
    opted_in = stack.key_client("tenant-exact", cache_mode="exact")
    _ask(opted_in, question)
    assert _ask(opted_in, question)[0] == "exact"
    assert _ask(opted_in, question, extra_body={"cache": "off"})[0] is None


def test_the_header_opts_in_as_the_body_does(stack):
    client, question = stack.client(), _unique("Spell 'cache'.")
    _ask(client, question, extra_headers={"x-tokenfleet-cache": "exact"})
    assert _ask(client, question, extra_headers={"x-tokenfleet-cache": "exact"})[0] == "exact"


def test_an_unknown_cache_mode_is_a_400_naming_the_field(stack):
    with pytest.raises(openai.BadRequestError) as err:
        _ask(stack.client(), "hi", extra_body={"cache": "sometimes"})
    assert err.value.body["param"] == "cache"


def test_a_paraphrase_is_answered_from_the_semantic_cache_and_a_negation_is_not(stack):
    client, topic = stack.client(), uuid.uuid4().hex[:6]
    asked = f"How do I enable dark mode in the {topic} app?"
    _, first = _ask(client, asked, extra_body={"cache": "semantic"})
    paraphrase_mark, paraphrase = _ask(client, f"How can I enable dark mode in the {topic} app?",
                                       extra_body={"cache": "semantic"})
    negation_mark, _ = _ask(client, f"How do I disable dark mode in the {topic} app?",
                            extra_body={"cache": "semantic"})
    assert paraphrase_mark == "semantic" and paraphrase.choices[0].message.content == first.choices[0].message.content
    assert negation_mark == "miss"
    assert stack.completion_event(paraphrase.id).routing.cache == "semantic"
