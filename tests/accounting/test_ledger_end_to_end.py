"""Through the whole stack: every request the gateway answers becomes one ledger row whose tokens equal the
response's usage, with its costs, timings, decisions and status."""

from __future__ import annotations

import urllib.request

import openai
import pytest

from services.base import protocol as p
from tests.stack import MODEL

pytestmark = pytest.mark.usefixtures("stack")


def test_a_request_becomes_one_ledger_row_with_the_responses_usage(stack):
    response = stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about ledgers."}], max_tokens=6, temperature=0)
    row = stack.ledger_row(response.id)
    assert (row.prompt_tokens, row.completion_tokens) == (response.usage.prompt_tokens,
                                                          response.usage.completion_tokens)
    assert (row.tenant, row.model, row.status, row.tier) == ("dev", MODEL, "ok", "small")
    assert row.worker_class == "cpu" and row.gpu_seconds > 0 and row.measured_cost_usd > 0 and row.list_cost_usd > 0
    assert row.e2e_s >= row.ttft_s > 0 and row.routing_reason.startswith("named by the request")
    timing = response.model_extra["tokenfleet"]  # where the time went, the router's part too
    assert 0 <= timing["route_s"] <= timing["queue_s"] <= timing["ttft_s"] <= timing["e2e_s"]


def test_a_streamed_request_is_recorded_with_the_usage_of_its_final_chunk(stack):
    chunks = list(stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Stream it."}], max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    row = stack.ledger_row(chunks[-1].id)
    assert row.completion_tokens == chunks[-1].usage.completion_tokens == 5


def test_a_response_cache_hit_is_recorded_as_one(stack):
    client, question = stack.client(), "What does a ledger row hold? (ledger e2e)"
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=4, temperature=0,
                  extra_body={"cache": "exact"})
    client.chat.completions.create(**kwargs)
    hit = client.chat.completions.create(**kwargs)
    row = stack.ledger_row(hit.id)
    assert (row.cache_result, row.worker_id, float(row.measured_cost_usd)) == ("exact", "response-cache", 0.0)


def test_a_prompt_past_the_context_is_refused_by_the_gateway_before_it_is_queued(stack):
    with pytest.raises(openai.BadRequestError) as err:
        stack.client().completions.create(model=MODEL, prompt="x " * 5000, max_tokens=4)
    assert (err.value.body["code"], err.value.body["param"]) == ("context_length_exceeded", "prompt")
    request_id = err.value.response.headers["x-request-id"]
    entries = stack.redis().xrange(p.REQUESTS_STREAM)  # raw: other tests leave entries that do not decode
    assert not [fields for _, fields in entries if request_id in (p.raw_message(fields) or "")]


def test_a_request_the_worker_rejects_is_recorded_as_rejected_not_as_a_failure(stack):
    with pytest.raises(openai.BadRequestError) as err:  # only the worker knows its model's vocabulary
        stack.client().completions.create(model=MODEL, prompt=[10**8], max_tokens=4)
    row = stack.ledger_row("cmpl-" + err.value.response.headers["x-request-id"])
    assert (row.status, row.completion_tokens) == ("rejected", 0)


def test_the_sla_class_a_request_names_is_the_one_its_row_is_judged_by(stack):
    response = stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "No hurry."}], max_tokens=3, extra_body={"sla": "batch"})
    row = stack.ledger_row(response.id)
    assert (row.sla_class, row.sla_met) == ("batch", True)


def test_an_unknown_sla_class_is_a_400_naming_the_field(stack):
    with pytest.raises(openai.BadRequestError) as err:
        stack.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                               max_tokens=2, extra_body={"sla": "platinum"})
    assert err.value.body["param"] == "sla" and "batch" in err.value.body["message"]


def test_the_accounting_service_counts_cost_tasks_and_sla_met_for_prometheus(stack):
    def samples() -> dict[str, float]:
        port = stack.env["TOKENFLEET_ACCOUNTING_PORT"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            lines = response.read().decode().splitlines()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
                if line.startswith("tokenfleet")}

    before = samples()
    response = stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count my cost."}], max_tokens=4, temperature=0,
        extra_body={"sla": "batch"})  # an hour to finish: it meets its SLA whatever this machine's load
    row = stack.ledger_row(response.id)
    after = samples()

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew(f'tokenfleet:tasks_total{{model="{MODEL}",status="ok"}}') >= 1
    assert grew(f'tokenfleet:cost_usd_total{{kind="list",model="{MODEL}"}}') >= float(row.list_cost_usd) * 0.999999 > 0
    assert row.sla_met and grew(f'tokenfleet:sla_met_total{{model="{MODEL}",sla_class="batch"}}') >= 1
    assert grew(f'tokenfleet:output_tokens_total{{model="{MODEL}"}}') >= 4
