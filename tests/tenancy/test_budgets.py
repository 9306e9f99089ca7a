"""Per-key rate limits and USD budgets (services/tenancy/budgets.py): the reservation script against a real Redis, with
an injected clock, then the same limits through the running gateway with the real `openai` client."""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import httpx
import openai
import pytest

from services.base import protocol as p
from services.base.redis_client import connect
from services.base.settings import RouterSettings
from services.launcher import cli
from services.openai_api.schemas import ChatCompletionRequest, RequestError, parse
from services.tenancy.auth import ApiKey, authenticate, hash_key, register_key
from services.tenancy.budgets import Estimate, Estimator, budget_state, release, reserve, settle
from services.tenancy.prices import PriceTable
from tests.stack import MODEL

EST = Estimate(prompt_tokens=10, output_tokens=4, usd=0.001)
NOW = datetime(2025, 6, 15, 12, 0, 10, tzinfo=UTC).timestamp()  # 10 s into a minute, mid-day, mid-month
DAY = 86_400


def _run(redis_url: str, work):
    """`work(redis)` on a fresh connection, in its own event loop."""
    async def go():
        redis = connect(redis_url)
        try:
            return await work(redis)
        finally:
            await redis.aclose()

    return asyncio.run(go())


HOLD_S = 900  # a reservation's hold: the request's timeout and a margin


def _key(**limits) -> ApiKey:
    return ApiKey(uuid.uuid4().hex, "tenant", **limits)


async def _attempt(redis, key: ApiKey, estimate: Estimate = EST, now: float = NOW) -> str:
    """The request's id when admitted, else the refusal's code."""
    request_id = uuid.uuid4().hex
    try:
        await reserve(redis, key, request_id, estimate, now, HOLD_S)
    except RequestError as exc:
        return exc.error.code
    return request_id


def _admitted(outcomes: list[str]) -> list[str]:
    return [o for o in outcomes if o not in ("insufficient_quota", "rate_limit_exceeded")]


def test_concurrent_reservations_never_exceed_the_budget(redis_url):
    """LiteLLM #34732: checking the spend, then spending, lets parallel requests through the same headroom."""
    key = _key(budget_usd=10 * EST.usd, budget_period="total")

    async def work(redis):
        first = await asyncio.gather(*(_attempt(redis, key) for _ in range(50)))
        after_first = await budget_state(redis, key, NOW)
        for request_id in _admitted(first):
            await settle(redis, request_id, EST.usd / 2)  # the requests cost half their estimate
        second = await asyncio.gather(*(_attempt(redis, key) for _ in range(50)))
        return first, after_first, second, await budget_state(redis, key, NOW)

    first, after_first, second, final = _run(redis_url, work)
    assert len(_admitted(first)) == 10 and first.count("insufficient_quota") == 40
    assert after_first.spent_usd + after_first.reserved_usd <= key.budget_usd
    assert len(_admitted(second)) == 5
    assert final.spent_usd + final.reserved_usd == pytest.approx(key.budget_usd)
    assert final.spent_usd + final.reserved_usd <= key.budget_usd


def test_settling_twice_charges_once(redis_url):
    key = _key(budget_usd=1.0)

    async def work(redis):
        request_id = await _attempt(redis, key)
        settled = [await settle(redis, request_id, 0.0004), await settle(redis, request_id, 0.0004)]
        return settled, await budget_state(redis, key, NOW)

    settled, state = _run(redis_url, work)
    assert settled == [True, False]
    assert (state.spent_usd, state.reserved_usd) == (pytest.approx(0.0004), 0.0)


def test_settling_again_at_a_lower_cost_charges_the_lower_cost(redis_url):
    """The request's ledger row was cut to the tokens its client got: the budget gives the difference back."""
    key = _key(budget_usd=1.0)

    async def work(redis):
        request_id = await _attempt(redis, key)
        settled = [await settle(redis, request_id, 0.0004), await settle(redis, request_id, 0.0001),
                   await settle(redis, request_id, 0.0001)]
        return settled, await budget_state(redis, key, NOW), await release(redis, request_id)

    settled, state, released = _run(redis_url, work)
    assert settled == [True, True, False]
    assert (state.spent_usd, state.reserved_usd) == (pytest.approx(0.0001), 0.0)
    assert released == 0.0  # a settled request holds nothing to release


def test_release_returns_the_reserved_amount(redis_url):
    key = _key(budget_usd=EST.usd, budget_period="total")  # fits one request

    async def work(redis):
        held = await _attempt(redis, key)
        refused = await _attempt(redis, key)
        returned = [await release(redis, held), await release(redis, held)]
        return refused, returned, await _attempt(redis, key), await budget_state(redis, key, NOW)

    refused, returned, again, state = _run(redis_url, work)
    assert refused == "insufficient_quota"
    assert returned == [pytest.approx(EST.usd), 0.0]
    assert again not in ("insufficient_quota", "rate_limit_exceeded")
    assert (state.spent_usd, state.reserved_usd) == (0.0, pytest.approx(EST.usd))


def test_a_request_released_in_doubt_is_still_charged_when_it_is_settled(redis_url):
    key = _key(budget_usd=1.0, budget_period="total")

    async def work(redis):
        request_id = await _attempt(redis, key)
        await release(redis, request_id)
        return await settle(redis, request_id, 0.0007), await budget_state(redis, key, NOW)

    settled, state = _run(redis_url, work)
    assert settled and (state.spent_usd, state.reserved_usd) == (pytest.approx(0.0007), 0.0)


def test_settling_or_releasing_an_unknown_request_changes_nothing(redis_url):
    request_id = uuid.uuid4().hex

    async def work(redis):
        outcome = await settle(redis, request_id, 0.5), await release(redis, request_id)
        return outcome, await redis.keys(f"*{request_id}*")

    assert _run(redis_url, work) == ((False, 0.0), [])


def test_a_daily_budget_renews_when_the_day_rolls_over_and_a_late_settle_charges_its_own_day(redis_url):
    key = _key(budget_usd=EST.usd, budget_period="day")

    async def work(redis):
        today = await _attempt(redis, key)
        refused_today = await _attempt(redis, key, now=NOW + 60)
        tomorrow = await _attempt(redis, key, now=NOW + DAY)
        await settle(redis, today, 0.0002)  # settled after midnight: charged to the day it was reserved in
        return refused_today, tomorrow, await budget_state(redis, key, NOW), await budget_state(redis, key, NOW + DAY)

    refused_today, tomorrow, day_one, day_two = _run(redis_url, work)
    assert refused_today == "insufficient_quota"
    assert tomorrow not in ("insufficient_quota", "rate_limit_exceeded")
    assert (day_one.spent_usd, day_one.reserved_usd) == (pytest.approx(0.0002), 0.0)
    assert (day_two.spent_usd, day_two.reserved_usd) == (0.0, pytest.approx(EST.usd))


def test_a_reservation_never_settled_is_returned_after_its_deadline(redis_url):
    key = _key(budget_usd=EST.usd, budget_period="total")

    async def work(redis):
        await _attempt(redis, key)  # its gateway and worker died: nobody settles it
        before_deadline = await _attempt(redis, key, now=NOW + HOLD_S - 1)
        return before_deadline, await _attempt(redis, key, now=NOW + HOLD_S + 1)

    before_deadline, after_deadline = _run(redis_url, work)
    assert before_deadline == "insufficient_quota"
    assert after_deadline not in ("insufficient_quota", "rate_limit_exceeded")


def test_the_fourth_request_of_a_minute_over_rpm_3_waits_for_the_windows_end(redis_url):
    key = _key(rpm=3)

    async def work(redis):
        admitted = [await _attempt(redis, key, now=NOW + i) for i in range(3)]
        with pytest.raises(RequestError) as refused:
            await reserve(redis, key, "fourth", EST, NOW + 3, HOLD_S)
        return admitted, refused.value, await _attempt(redis, key, now=NOW + 50)

    admitted, refused, next_minute = _run(redis_url, work)
    assert len(_admitted(admitted)) == 3
    assert (refused.error.status, refused.error.code, refused.error.type) == (429, "rate_limit_exceeded", "requests")
    assert refused.headers["Retry-After"] == "47"  # the window started 10 s before NOW
    assert next_minute not in ("insufficient_quota", "rate_limit_exceeded")


def test_tokens_per_minute_count_each_requests_estimate(redis_url):
    key = _key(tpm=2 * EST.tokens + 1)

    async def work(redis):
        outcomes = [await _attempt(redis, key) for _ in range(3)]
        with pytest.raises(RequestError) as refused:
            await reserve(redis, key, "third", EST, NOW, HOLD_S)
        return outcomes, refused.value

    outcomes, refused = _run(redis_url, work)
    assert len(_admitted(outcomes)) == 2 and outcomes[2] == "rate_limit_exceeded"
    assert (refused.error.type, refused.headers["Retry-After"]) == ("tokens", "50")


def test_a_request_that_can_never_fit_is_refused_without_retry(redis_url):
    async def work(redis):
        with pytest.raises(RequestError) as too_many_tokens:
            await reserve(redis, _key(tpm=EST.tokens - 1), "big", EST, NOW, HOLD_S)
        with pytest.raises(RequestError) as too_costly:
            await reserve(redis, _key(budget_usd=EST.usd / 2), "costly", EST, NOW, HOLD_S)
        return too_many_tokens.value, too_costly.value

    too_many_tokens, too_costly = _run(redis_url, work)
    assert (too_many_tokens.error.type, too_costly.error.code) == ("tokens", "insufficient_quota")
    assert too_many_tokens.headers == too_costly.headers == {"x-should-retry": "false"}


def test_keys_create_stores_the_limits(redis_url, monkeypatch, capsys):
    monkeypatch.setenv("REDIS_URL", redis_url)
    assert cli.main(["keys", "create", "limited-tenant", "--rpm", "3", "--tpm", "100", "--budget-usd", "1.5",
                     "--budget-period", "day"]) == 0
    key = capsys.readouterr().out.strip()
    found = _run(redis_url, lambda redis: authenticate(redis, f"Bearer {key}"))
    assert (found.rpm, found.tpm, found.budget_usd, found.budget_period, found.limited) == (3, 100, 1.5, "day", True)


# Through the running gateway


def _register(stack, **limits) -> str:
    return _run(stack.redis_url, lambda redis: register_key(redis, f"budget-{uuid.uuid4().hex[:6]}", **limits))


def _client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


def _body(content: str = "Say something.", max_tokens: int = 4) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def _estimate(stack, body: dict) -> Estimate:
    """What the gateway estimates for `body`: its estimator over the default table and the served model."""
    message = parse(ChatCompletionRequest, body).to_message("estimate", "tenant", "tenant:tenant")
    tiers = RouterSettings()
    return _run(stack.redis_url, lambda redis: Estimator(redis, PriceTable.load(), (
        tiers.small_model, tiers.large_model)).estimate(message))


def _in_one_minute(seconds: float = 20) -> None:
    """Sleeps past the next minute boundary when fewer than `seconds` of this one are left."""
    if (left := 60 - time.time() % 60) < seconds:
        time.sleep(left + 0.2)


def test_parallel_requests_through_the_gateway_never_overspend_the_budget(stack):
    estimate = _estimate(stack, _body())
    budget = 10.5 * estimate.usd  # fits 10 requests' estimates, not 11
    client = _client(stack, _register(stack, budget_usd=budget, budget_period="total"))

    def ask(_):
        try:
            return client.chat.completions.create(**_body())
        except openai.RateLimitError as exc:
            return exc.body["code"]

    with ThreadPoolExecutor(50) as pool:
        outcomes = list(pool.map(ask, range(50)))
    answers = [o for o in outcomes if not isinstance(o, str)]
    assert outcomes.count("insufficient_quota") == 50 - len(answers)
    prices = PriceTable.load()
    costs = [prices.list_cost(MODEL, a.usage.prompt_tokens, a.usage.prompt_tokens_details.cached_tokens,
                              a.usage.completion_tokens) for a in answers]  # as the ledger charges them
    assert sum(costs) <= budget
    # Exactly 10 while nothing settles (the Lua test above); the stack's accounting service settles finished
    # requests at their actual cost, below the estimate, which may free room for one or two more, never more
    # than the budget covers at actual cost.
    assert 10 <= len(answers) <= budget // min(costs)


def test_the_fourth_request_in_a_minute_under_rpm_3_gets_429_with_retry_after(stack):
    key = _register(stack, rpm=3)
    _in_one_minute()
    codes = [httpx.post(stack.url + "/v1/chat/completions", json=_body(max_tokens=1), timeout=60,
                        headers={"Authorization": f"Bearer {key}"}) for _ in range(4)]
    assert [r.status_code for r in codes] == [200, 200, 200, 429]
    assert codes[3].json()["error"] | {"message": None} == {"message": None, "type": "requests", "param": None,
                                                           "code": "rate_limit_exceeded"}
    assert 1 <= int(codes[3].headers["retry-after"]) <= 60


def test_tokens_per_minute_refuse_the_request_that_would_pass_them(stack):
    estimate = _estimate(stack, _body(max_tokens=2))
    key = _register(stack, tpm=2 * estimate.tokens)
    _in_one_minute()
    codes = [httpx.post(stack.url + "/v1/chat/completions", json=_body(max_tokens=2), timeout=60,
                        headers={"Authorization": f"Bearer {key}"}) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]
    assert codes[2].json()["error"]["type"] == "tokens" and 1 <= int(codes[2].headers["retry-after"]) <= 60


def test_a_request_refused_by_the_queue_admission_gets_its_reservation_back(stack):
    info = p.ModelInfo(name="ghost-budget", model_dir="/nowhere", max_model_len=2048)
    stack.redis().hset(p.MODELS_KEY, info.name, info.model_dump_json())  # served once, no live worker now
    key = _register(stack, budget_usd=1.0)
    try:
        response = httpx.post(stack.url + "/v1/chat/completions", json={**_body(), "model": info.name},
                              headers={"Authorization": f"Bearer {key}"}, timeout=60)
    finally:
        stack.redis().hdel(p.MODELS_KEY, info.name)
    assert response.status_code == 503
    state = _run(stack.redis_url, lambda redis: budget_state(redis, ApiKey(hash_key(key), "", budget_usd=1.0)))
    assert (state.spent_usd, state.reserved_usd) == (0.0, 0.0)


def test_a_key_without_limits_costs_no_budget_round_trip(stack):
    def commands(client: openai.OpenAI) -> list[str]:
        """Every command Redis ran while `client` made one request."""
        sentinel, seen = f"end-{uuid.uuid4().hex}", []
        with stack.redis().monitor() as monitor:
            client.chat.completions.create(**_body(max_tokens=1))
            stack.redis().echo(sentinel)
            while sentinel not in (command := monitor.next_command()["command"]):
                seen.append(command)
        return seen

    def budget_commands(seen: list[str]) -> list[str]:
        """The gateway's: the accounting service's settlement (one HMGET of the reservation, after the request
        finished) is not on the request's path."""
        return [c for c in seen if (":budget:" in c or ":rl:" in c) and not c.startswith("HMGET tf:budget:res:")]

    assert budget_commands(commands(_client(stack, _register(stack, rpm=100))))  # the probe sees them
    assert budget_commands(commands(stack.client(max_retries=0))) == []  # the dev key has no limits


def test_a_finished_request_is_settled_at_its_ledger_cost_and_its_reservation_freed(stack):
    key = _register(stack, budget_usd=1.0, budget_period="total")
    response = _client(stack, key).chat.completions.create(**_body())
    row = stack.ledger_row(response.id)
    api_key = ApiKey(hash_key(key), "", budget_usd=1.0, budget_period="total")
    deadline = time.monotonic() + 10
    while (state := _run(stack.redis_url, lambda redis: budget_state(redis, api_key))).reserved_usd:
        assert time.monotonic() < deadline, "the reservation was never settled"
        time.sleep(0.1)
    assert state.spent_usd == pytest.approx(float(row.list_cost_usd), abs=1e-9)
