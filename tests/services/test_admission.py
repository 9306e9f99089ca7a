"""Admission on a real Redis: the queue-depth bound holds however many requests (and gateways) arrive at
once, `auto` counts against the tiers it may land on, and a max_tokens or a prompt no model context can hold is
a 400 before anything is queued (the prompt counted with the model's own tokenizer)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from gateway.admission import Admission, inflight_key
from gateway.schemas import RequestError
from services import protocol as p
from services.redis_client import connect
from services.settings import GatewaySettings, RouterSettings

DEPTH = 4


def _run(redis_url: str, scenario, model_dir: str = "/m", max_model_len: int = 2048):
    """`model_dir`: the served models' checkpoint (by default none on this host: prompts are not counted)."""
    async def go():
        redis = connect(redis_url)
        small, large = f"small-{uuid.uuid4().hex[:8]}", f"large-{uuid.uuid4().hex[:8]}"
        try:
            for name in (small, large):  # served, with a live worker
                info = p.ModelInfo(name=name, model_dir=model_dir, max_model_len=max_model_len)
                await redis.hset(p.MODELS_KEY, name, info.model_dump_json())
                await redis.zadd(p.workers_key(name), {"w": time.time() + 60})
            return await scenario(redis, small, large)
        finally:
            await redis.hdel(p.MODELS_KEY, small, large)
            await redis.aclose()

    return asyncio.run(go())


def _admission(redis, small: str, large: str, max_events_backlog: int = 10**9) -> Admission:
    """One gateway's admission (several instances stand for several gateways)."""
    return Admission(redis, GatewaySettings(max_queue_depth=DEPTH), RouterSettings(small_model=small,
                                                                                     large_model=large),
                     max_events_backlog)


def _request(model: str, request_id: str | None = None, max_tokens: int | None = None,
             prompt: str = "hi") -> p.GenerateRequest:
    return p.GenerateRequest(request_id=request_id or uuid.uuid4().hex, kind="completion", model=model,
                             prompt=prompt, sampling=p.SamplingOptions(max_tokens=max_tokens))


async def _outcome(admission: Admission, model: str, **request) -> str:
    try:
        await admission.admit(_request(model, **request))
    except RequestError as exc:
        return exc.error.code
    return "admitted"


def test_forty_parallel_requests_from_four_gateways_admit_exactly_the_queue_depth(redis_url):
    async def scenario(redis, small, large):
        gateways = [_admission(redis, small, large) for _ in range(4)]
        return await asyncio.gather(*(_outcome(gateways[i % 4], small) for i in range(40)))

    outcomes = _run(redis_url, scenario)
    assert outcomes.count("admitted") == DEPTH and outcomes.count("queue_full") == 40 - DEPTH


def test_auto_requests_count_against_both_tiers_queues(redis_url):
    async def scenario(redis, small, large):
        admission = _admission(redis, small, large)
        autos = [await _outcome(admission, p.AUTO_MODEL) for _ in range(DEPTH)]
        return autos, await _outcome(admission, small), await _outcome(admission, large)

    autos, small_after, large_after = _run(redis_url, scenario)
    assert autos == ["admitted"] * DEPTH and small_after == large_after == "queue_full"


def test_a_released_request_frees_its_place_in_every_queue_it_took(redis_url):
    async def scenario(redis, small, large):
        admission, rid = _admission(redis, small, large), uuid.uuid4().hex
        await admission.admit(_request(p.AUTO_MODEL, rid))
        for _ in range(DEPTH - 1):
            await _outcome(admission, small)
        full = await _outcome(admission, small)
        await admission.release(p.AUTO_MODEL, rid)
        return full, await _outcome(admission, small)

    assert _run(redis_url, scenario) == ("queue_full", "admitted")


@pytest.mark.parametrize(("max_tokens", "outcome"), [(2048, "invalid_value"), (10**9, "invalid_value"),
                                                     (2047, "admitted")])
def test_max_tokens_must_leave_room_for_a_prompt_in_the_models_context(redis_url, max_tokens, outcome):
    async def scenario(redis, small, large):
        return await _outcome(_admission(redis, small, large), small, max_tokens=max_tokens)

    assert _run(redis_url, scenario) == outcome


def test_work_is_refused_with_503_while_unrecorded_completion_events_exceed_their_bound(redis_url):
    async def scenario(redis, small, large):
        backlog = await redis.xlen(p.EVENTS_STREAM)
        return (await _outcome(_admission(redis, small, large, max_events_backlog=backlog + 1), small),
                await _outcome(_admission(redis, small, large, max_events_backlog=backlog), small))

    assert _run(redis_url, scenario) == ("admitted", "accounting_backlog")


def _prompt_of(model_dir, tokens: int) -> str:
    """A text its model's tokenizer makes exactly `tokens` tokens of (the worker's own `Tokenizer`)."""
    from gpu_worker.engine.checkpoint import open_checkpoint

    tokenizer = open_checkpoint(str(model_dir)).tokenizer()
    text = " ".join(["hello"] * tokens)
    while len(tokenizer.encode(text)) > tokens:
        text = text[:-1]
    assert len(tokenizer.encode(text)) == tokens
    return text


@pytest.mark.parametrize(("prompt_tokens", "max_tokens", "outcome"),
                         [(40, 24, "admitted"), (40, 25, "context_length_exceeded"), (63, None, "admitted"),
                          (64, None, "context_length_exceeded")])
def test_a_prompt_and_max_tokens_past_the_context_are_refused_counted_with_the_models_tokenizer(
        redis_url, make_checkpoint, prompt_tokens, max_tokens, outcome):
    model_dir = make_checkpoint("llama")
    prompt = _prompt_of(model_dir, prompt_tokens)

    async def scenario(redis, small, large):
        return await _outcome(_admission(redis, small, large), small, max_tokens=max_tokens, prompt=prompt)

    assert _run(redis_url, scenario, str(model_dir), max_model_len=64) == outcome


def test_a_prompt_past_the_context_is_refused_before_it_takes_a_place_in_the_queue(redis_url, make_checkpoint):
    model_dir = make_checkpoint("llama")
    prompt = _prompt_of(model_dir, 80)

    async def scenario(redis, small, large):
        admission = _admission(redis, small, large)
        try:
            await admission.admit(_request(small, prompt=prompt))
        except RequestError as exc:
            error = exc.error
        return error, await redis.zcard(inflight_key(small))

    error, queued = _run(redis_url, scenario, str(model_dir), max_model_len=64)
    assert (error.status, error.code, error.param, queued) == (400, "context_length_exceeded", "prompt", 0)
    assert error.message.startswith("This model's maximum context length is 64 tokens. However, your prompt "
                                    "resulted in 80 tokens.")


def test_a_prompt_far_shorter_than_the_context_is_admitted_without_loading_a_tokenizer(redis_url, make_checkpoint):
    """Loading one takes seconds and 100+ MB: a gateway pays it only once a prompt could be too long."""
    from gateway.context_window import ContextWindow

    context = ContextWindow()

    async def scenario(redis, small, large):
        admission = Admission(redis, GatewaySettings(), RouterSettings(small_model=small, large_model=large), 10**9,
                              context)
        await admission.admit(_request(small, prompt="A short question?", max_tokens=16))
        return context.encoder._cached.cache_info().currsize

    assert _run(redis_url, scenario, str(make_checkpoint("llama")), max_model_len=2048) == 0


def test_a_prompt_too_long_to_be_worth_tokenizing_is_refused_from_its_size(redis_url, make_checkpoint):
    """Bytes past the context times the longest token's bytes: refused at once, never tokenized (a 4 MB prompt
    took 3 s and 465 MB of a process to tokenize)."""
    from gateway.context_window import ContextWindow

    context = ContextWindow()
    model_dir = str(make_checkpoint("llama"))
    longest = context.encoder._tokenizer(model_dir).longest_token_bytes
    prompt = "x" * (longest * 65)

    async def scenario(redis, small, large):
        admission = Admission(redis, GatewaySettings(), RouterSettings(small_model=small, large_model=large), 10**9,
                              context)
        encoded = []
        context.encoder.prompt_ids = lambda *args: encoded.append(args)  # records a tokenizing, were there one
        try:
            await admission.admit(_request(small, prompt=prompt))
        except RequestError as exc:
            return exc.error, encoded
        return None, encoded

    error, encoded = _run(redis_url, scenario, model_dir, max_model_len=64)
    assert (error.code, encoded) == ("context_length_exceeded", [])
    assert "your prompt resulted in more than 65 tokens" in error.message
