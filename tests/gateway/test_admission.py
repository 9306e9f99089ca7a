"""Admission on a real Redis: the queue-depth bound holds however many requests (and gateways) arrive at
once, `auto` counts against the tiers it may land on, a max_tokens or a prompt no model context can hold is a
400 before anything is queued (the prompt counted with the model's own tokenizer), and the admitted request
carries its prompt's ids, tokenized once per tokenizer."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
from transformers import PreTrainedTokenizerFast

from services.base import protocol as p
from services.base.redis_client import connect
from services.base.settings import GatewaySettings, RouterSettings
from services.openai_api.admission import Admission, inflight_key
from services.openai_api.context_window import ContextWindow
from services.openai_api.schemas import RequestError
from services.text.prompt_encoder import PromptEncoder
from services.text.tokenizer_files import open_tokenizer

DEPTH = 4


def _run(redis_url: str, scenario, model_dir: str = "/m", max_model_len: int = 2048, large_dir: str | None = None):
    """`model_dir`: the served models' checkpoint (by default none on this host: prompts are not counted);
    `large_dir`: the large tier's, when it differs."""
    async def go():
        redis = connect(redis_url)
        small, large = f"small-{uuid.uuid4().hex[:8]}", f"large-{uuid.uuid4().hex[:8]}"
        try:
            for name, checkpoint in ((small, model_dir), (large, large_dir or model_dir)):  # served, worker alive
                info = p.ModelInfo(name=name, model_dir=checkpoint, max_model_len=max_model_len)
                await redis.hset(p.MODELS_KEY, name, info.model_dump_json())
                await redis.zadd(p.workers_key(name), {"w": time.time() + 60})
            return await scenario(redis, small, large)
        finally:
            await redis.hdel(p.MODELS_KEY, small, large)
            await redis.aclose()

    return asyncio.run(go())


def _admission(redis, small: str, large: str, max_events_backlog: int = 10**9,
               context: ContextWindow | None = None) -> Admission:
    """One gateway's admission (several instances stand for several gateways)."""
    return Admission(redis, GatewaySettings(max_queue_depth=DEPTH), RouterSettings(small_model=small,
                                                                                     large_model=large),
                     max_events_backlog, context)


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
    tokenizer = open_tokenizer(model_dir)
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


class _HeldLoad(PromptEncoder):
    """Its tokenizers load only once `release` is set: a load that takes seconds, held as long as a test needs."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def _load(self, model_dir: str):
        self.release.wait(60)
        return PromptEncoder._load(model_dir)


def test_a_short_prompt_does_not_wait_for_a_tokenizer_still_loading_and_later_ones_carry_their_ids(
        redis_url, make_checkpoint):
    """Loading one takes seconds and 100+ MB: a prompt that surely fits is admitted meanwhile, untokenized (the
    router tokenizes it), while the tokenizer loads in the background for the requests after it."""
    model_dir = str(make_checkpoint("llama"))
    encoder = _HeldLoad()
    first, second = _request("small", prompt="A short question?"), _request("small", prompt="Another one?")

    async def scenario(redis, small, large):
        first.model = second.model = small
        admission = _admission(redis, small, large, context=ContextWindow(encoder))
        await admission.admit(first)
        encoder.release.set()
        assert encoder.warm(model_dir)
        await admission.admit(second)

    _run(redis_url, scenario, model_dir)
    tokenizer = open_tokenizer(model_dir)
    assert first.prompt_token_ids is None
    assert second.prompt_token_ids == p.PromptTokenIds(ids={tokenizer.fingerprint: tokenizer.encode("Another one?")},
                                                       tokenizers={second.model: tokenizer.fingerprint})


def test_an_auto_request_carries_one_tokenization_for_tiers_whose_tokenizers_are_the_same_files(
        redis_url, make_checkpoint):
    """Two checkpoints (two paths, two architectures) with one tokenizer: tokenized once, keyed by the
    tokenizer's fingerprint, and each tier pointing at it."""
    small_dir, large_dir = str(make_checkpoint("llama")), str(make_checkpoint("qwen2"))
    context = ContextWindow()
    assert context.encoder.warm(small_dir) and context.encoder.warm(large_dir)
    request = _request(p.AUTO_MODEL, prompt="Which tier am I?")

    async def scenario(redis, small, large):
        await _admission(redis, small, large, context=context).admit(request)
        return small, large

    small, large = _run(redis_url, scenario, small_dir, large_dir=large_dir)
    tokenizer = open_tokenizer(small_dir)
    assert request.prompt_token_ids == p.PromptTokenIds(
        ids={tokenizer.fingerprint: tokenizer.encode("Which tier am I?")},
        tokenizers={small: tokenizer.fingerprint, large: tokenizer.fingerprint})


def test_a_chat_its_template_refuses_is_admitted_without_ids_for_its_worker_to_answer(redis_url, hf_tokenizer,
                                                                                       tmp_path):
    hf_tokenizer.save_pretrained(tmp_path)
    strict = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    strict.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    strict.save_pretrained(tmp_path)
    context = ContextWindow()
    assert context.encoder.warm(str(tmp_path))
    request = p.GenerateRequest(request_id=uuid.uuid4().hex, kind="chat", model="small",
                                messages=[{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}],
                                sampling=p.SamplingOptions(max_tokens=8))

    async def scenario(redis, small, large):
        request.model = small
        await _admission(redis, small, large, context=context).admit(request)

    _run(redis_url, scenario, str(tmp_path))
    assert request.prompt_token_ids is None


def test_a_prompt_too_long_to_be_worth_tokenizing_is_refused_from_its_size(redis_url, make_checkpoint):
    """Bytes past the context times the longest token's bytes: refused at once, never tokenized (a 4 MB prompt
    took 3 s and 465 MB of a process to tokenize)."""
    context = ContextWindow()
    model_dir = str(make_checkpoint("llama"))
    longest = context.encoder.tokenizer(model_dir).longest_token_bytes
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
