"""Speculative decoding with n-gram (prompt lookup) guesses: greedy and seeded output is the non-speculative output
token for token, with guesses actually kept; the verifier's tokens follow the request's distribution; and every stop
condition inside a run of kept guesses holds exactly."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine import LLM, SamplingParams
from gpu_worker.engine.ops import TorchOps
from gpu_worker.engine.sampler import Sampler, SamplingBatch, position_uniform
from gpu_worker.engine.scheduler_output import ScheduledChunk
from gpu_worker.engine.sequence import Sequence
from gpu_worker.engine.speculative import NgramProposer, Proposer, SpeculativeConfig, accepted_prefix, record_kept

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# Repetitive prompts: small random models fall into loops, which the n-gram proposer then predicts.
PROMPTS = [[5, 17, 42, 9, 33, 2, 71, 8] * 6, [90, 3, 3, 14] * 10, list(range(200, 260)), [7] * 30 + [8, 9]]


# Two prompts sharing two whole blocks (the second hits the prefix cache), then PROMPTS, one of them sampled twice.
MIXED = [[11, 12, 13, 14, 15, 16, 17, 18] * 4 + [1, 2, 3], [11, 12, 13, 14, 15, 16, 17, 18] * 4 + [4, 5], *PROMPTS]
MIXED_PARAMS = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, n=2 if i == 2 else 1)
                for i in range(len(MIXED))]


def _crowded(plain: LLM, caches: int = 1) -> dict:
    """Engine settings under which MIXED runs in 24-token steps (chunked prefill) over 16 blocks of 16 tokens,
    where its 8 sequences preempt one another (`caches`: 2 when a draft as large as the model has its own)."""
    cfg, kv_format = plain.engine.model_config, plain.engine.kv_format
    block = kv_format.bytes_per_block(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    return {"max_num_batched_tokens": 24, "max_model_len": 256, "kv_cache_memory_bytes": 16 * block * caches,
            "block_size": 16}


def _seq(tokens: list[int], **params) -> Sequence:
    return Sequence(0, "g", 0, list(tokens), len(tokens), SamplingParams(temperature=0.0, **params), seed=0)


def _guesses(proposer: Proposer, seq: Sequence, room: int) -> list[int]:
    """What the scheduler gets from the proposer for one decoding sequence."""
    k = proposer.max_guesses(seq, room)
    return proposer.propose([ScheduledChunk(seq, seq.num_tokens - 1, 1, [], True, max_guesses=k)])[0] if k else []


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3))
    # The suffix [1, 2] occurred twice before; its latest occurrence was followed by 7, 8, 1.
    assert _guesses(proposer, _seq([1, 2, 5, 6, 1, 2, 7, 8, 1, 2]), 10) == [7, 8, 1]
    assert _guesses(proposer, _seq([1, 2, 5, 6, 1, 2, 7, 8, 1, 2]), 2) == [7, 8]  # no more than room allows
    assert _guesses(proposer, _seq([1, 2, 3, 4]), 10) == []  # nothing repeats
    assert _guesses(proposer, _seq([4, 4, 4, 4]), 10) == [4]  # the latest occurrence, overlapping the suffix


def test_sampled_requests_and_requests_wanting_logprobs_or_penalties_get_guesses_too():
    proposer = NgramProposer(SpeculativeConfig("ngram", 3))
    repeating = [1, 2, 3, 1, 2, 3, 1, 2]
    assert _guesses(proposer, _seq(repeating, logprobs=2), 10) == [3, 1, 2]
    assert _guesses(proposer, _seq(repeating, repetition_penalty=1.2), 10) == [3, 1, 2]
    sampled = Sequence(0, "g", 0, repeating, 8, SamplingParams(temperature=0.8), seed=0)
    assert _guesses(proposer, sampled, 10) == [3, 1, 2]


def test_a_sequence_whose_guesses_are_mostly_rejected_gets_fewer_then_none_and_later_is_tried_again():
    proposer = NgramProposer(SpeculativeConfig("ngram", 4))
    seq = _seq([1, 2, 3, 4, 5, 6] * 3)
    assert len(_guesses(proposer, seq, 10)) == 4
    record_kept(seq, 4, 1)
    record_kept(seq, 4, 1)
    assert 1 <= len(_guesses(proposer, seq, 10)) < 4  # fewer guesses where fewer are kept
    for _ in range(3):
        record_kept(seq, 4, 0)
    silent = 0
    while not _guesses(proposer, seq, 10):
        silent += 1
    assert 5 <= silent <= 20  # a while without guesses, then tried again


def test_the_verifier_keeps_guesses_up_to_the_first_disagreement_then_the_models_token():
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all kept, plus the bonus token
    assert accepted_prefix([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accepted_prefix([4, 5, 6], [1, 5, 6, 7]) == [1]


class ReplayingProposer(Proposer):
    """Guesses the continuation a non-speculative run produced, every third guess wrong: the verifier must keep
    the right guesses up to the first wrong one and no further. (The tiny random test models never repeat
    themselves, so n-gram guesses would rarely be kept.)"""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], k: int = 4, max_batch: int = 64,
                 scheduler=None):
        super().__init__(k, max_batch)
        self.continuations = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}
        self.calls, self.scheduler, self.batch_sizes = 0, scheduler, []

    def max_guesses(self, seq: Sequence, room: int) -> int:
        return max(min(self.k, room), 0)

    def propose(self, chunks: list[ScheduledChunk]) -> list[list[int]]:
        if self.scheduler is not None:
            self.batch_sizes.append(len(self.scheduler.running))
        return [self._replay(c.seq, c.max_guesses) for c in chunks]

    def _replay(self, seq: Sequence, k: int) -> list[int]:
        self.calls += 1
        done = seq.num_output_tokens
        guesses = self.continuations[tuple(seq.token_ids[:seq.num_prompt_tokens])][done:done + k]
        return [g + 1 if (self.calls + i) % 3 == 0 else g for i, g in enumerate(guesses)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3-moe", "mixtral"])
def test_greedy_output_is_identical_with_ngram_speculation(make_checkpoint, arch):
    model = str(make_checkpoint(arch))
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = LLM(model, dtype="float32").generate(PROMPTS, params)
    # Small steps (chunked prefill, guesses bounded by the budget) and a pool small enough to preempt.
    fast = LLM(model, dtype="float32", speculative=NGRAM, max_num_batched_tokens=24, kv_cache_memory_bytes=1 << 20)
    assert [o.token_ids for o in fast.generate(PROMPTS, params)] == [o.token_ids for o in plain]
    assert fast.engine.stats()["spec_decode_num_draft_tokens"] > 0 and fast.engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_kept_guesses_and_rejected_ones_give_the_non_speculative_output_token_for_token(make_checkpoint, arch):
    """...in batches that mix chunked prefill, preemption, prefix-cache hits and n > 1."""
    model = str(make_checkpoint(arch))
    plain = LLM(model, dtype="float32")
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(MIXED, MIXED_PARAMS)]
    fast = LLM(model, dtype="float32", speculative=NGRAM, **_crowded(plain))
    fast.engine.scheduler.proposer = ReplayingProposer(MIXED, [w[0] for w in want], max_batch=8)
    assert [[c.token_ids for c in o.outputs] for o in fast.generate(MIXED, MIXED_PARAMS)] == want
    stats = fast.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["kv_blocks_used"] == 0


def test_guesses_are_counted_per_request_per_position_and_in_total(make_checkpoint):
    model = str(make_checkpoint("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = [o.token_ids for o in LLM(model, dtype="float32").generate(PROMPTS, params)]
    fast = LLM(model, dtype="float32", speculative=NGRAM)
    fast.engine.scheduler.proposer = ReplayingProposer(PROMPTS, plain)
    outputs = fast.generate(PROMPTS, params)
    totals = fast.engine.speculation
    assert sum(o.num_draft_tokens for o in outputs) == totals.num_draft_tokens
    assert sum(o.num_accepted_draft_tokens for o in outputs) == totals.num_accepted_tokens
    per_position = totals.accepted_per_position
    assert len(per_position) == 4 and sum(per_position) == totals.num_accepted_tokens
    # Every third guess is wrong, so the first is kept most often and a later one only after those before it.
    assert per_position == sorted(per_position, reverse=True) and per_position[0] < totals.num_drafts


def test_no_guesses_while_more_sequences_run_than_disable_by_batch_size(make_checkpoint):
    model = str(make_checkpoint("llama"))
    lengths = [6, 12, 24, 48]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    plain = [o.token_ids for o in LLM(model, dtype="float32").generate(PROMPTS, params)]
    fast = LLM(model, dtype="float32", speculative={**NGRAM, "disable_by_batch_size": 2})
    scheduler = fast.engine.scheduler
    scheduler.proposer = ReplayingProposer(PROMPTS, plain, max_batch=scheduler.proposer.max_batch, scheduler=scheduler)
    assert [o.token_ids for o in fast.generate(PROMPTS, params)] == plain
    sizes = scheduler.proposer.batch_sizes
    assert sizes and max(sizes) <= 2  # asked only once the two shortest requests had finished


def test_vllms_speculative_config_spelling_is_accepted_and_bad_settings_are_refused(make_checkpoint):
    model = str(make_checkpoint("llama"))
    assert LLM(model, dtype="float32", speculative_config=NGRAM).engine.scheduler.proposer.k == 4
    with pytest.raises(ValueError, match="not supported"):
        LLM(model, dtype="float32", speculative={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model, dtype="float32", speculative={"method": "ngram"})


@pytest.fixture(scope="module")
def replayed(make_checkpoint):
    """The plain engine, its greedy output for PROMPTS[0], and an engine whose guesses replay that output."""
    model = str(make_checkpoint("llama"))
    plain = LLM(model, dtype="float32")
    free = plain.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].token_ids
    fast = LLM(model, dtype="float32", speculative=NGRAM)
    fast.engine.scheduler.proposer = ReplayingProposer([PROMPTS[0]], [free])
    return plain, free, fast


def test_max_tokens_inside_a_run_of_kept_guesses_ends_the_output_exactly_there(replayed):
    _, free, fast = replayed
    for max_tokens in (1, 7, 13):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = fast.generate(PROMPTS[0], params)[0]
        assert out.token_ids == free[:max_tokens] and out.finish_reason == "length"


def test_a_stop_token_inside_a_run_of_kept_guesses_is_the_last_token(replayed):
    _, free, fast = replayed
    stop_at = free[-5]
    out = fast.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                   stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free[:free.index(stop_at) + 1] and out.finish_reason == "stop"


def test_a_stop_string_inside_a_run_of_kept_guesses_cuts_the_text_and_the_tokens(replayed):
    plain, free, fast = replayed
    text = plain.tokenizer.decode(free)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    want, got = plain.generate(PROMPTS[0], params)[0], fast.generate(PROMPTS[0], params)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert len(got.token_ids) < 40


SAMPLED = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, ignore_eos=True, seed=7),
           SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=8, repetition_penalty=1.3,
                          frequency_penalty=0.4, logprobs=2),
           SamplingParams(temperature=0.6, top_k=5, min_p=0.05, max_tokens=40, ignore_eos=True, seed=9, n=2),
           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]


def test_seeded_sampling_with_penalties_and_logprobs_gives_the_non_speculative_output(make_checkpoint):
    model = str(make_checkpoint("llama"))
    want = LLM(model, dtype="float32").generate(PROMPTS, SAMPLED)
    fast = LLM(model, dtype="float32", speculative=NGRAM, max_num_batched_tokens=24, kv_cache_memory_bytes=1 << 20)
    replayed = [o.token_ids for o in want]  # the first sample of each request
    fast.engine.scheduler.proposer = ReplayingProposer(PROMPTS, replayed)
    got = fast.generate(PROMPTS, SAMPLED)
    assert [o.token_ids for o in got] == replayed
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    for w, g in zip(want[1].outputs[0].logprobs, got[1].outputs[0].logprobs, strict=True):
        assert w.keys() == g.keys() and all(w[t] == pytest.approx(g[t], abs=1e-4) for t in w)
    stats = fast.engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def _target(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The distribution a request with these settings samples from, computed here independently of the sampler."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    probs[probs < probs.topk(top_k).values[-1]] = 0.0
    return probs / probs.sum()


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts.double() / counts.sum() - probs).abs().sum().item()


def test_the_verifier_keeps_a_guess_with_the_models_probability_and_otherwise_samples_the_residual():
    """Rejection sampling with a one-hot draft, checked as vLLM's rejection-sampler tests do: total-variation
    distance from the target distributions over 100 k draws (each a different seed) on a 6-token vocabulary."""
    draws, temperature, top_k = 100_000, 0.7, 4
    logits = torch.tensor([[1.0, 0.2, 2.0, -1.0, 0.5, 1.5], [0.3, 1.2, -0.5, 0.9, 2.2, 0.0]])
    guesses = [5, 4]
    p0, p1 = _target(logits[0], temperature, top_k), _target(logits[1], temperature, top_k)
    params = SamplingParams(temperature=temperature, top_k=top_k)
    batch = SamplingBatch([params] * 2 * draws, [position_uniform(seed, i) for seed in range(draws) for i in (0, 1)],
                          [[]] * 2 * draws, [[]] * 2 * draws)
    picks = [t.token_id for t in Sampler(TorchOps())(logits.repeat(draws, 1), batch)]
    outputs = [accepted_prefix(guesses[:1], picks[2 * d:2 * d + 2]) for d in range(draws)]
    first = torch.bincount(torch.tensor([o[0] for o in outputs]), minlength=6)
    assert _tv(first, p0) < 0.01  # what the request asked for, whatever was guessed
    kept = [o for o in outputs if len(o) == 2]
    assert len(kept) / draws == pytest.approx(p0[guesses[0]].item(), abs=0.006)  # min(1, p / q), q one-hot
    assert _tv(torch.bincount(torch.tensor([o[1] for o in kept]), minlength=6), p1) < 0.015  # the bonus token
    residual = p0.clone()
    residual[guesses[0]] = 0.0
    rejected = torch.bincount(torch.tensor([o[0] for o in outputs if len(o) == 1]), minlength=6)
    assert _tv(rejected, residual / residual.sum()) < 0.015  # (p - q)+, normalised


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_self_int8_draft_gives_the_non_speculative_greedy_output_and_most_of_its_guesses_are_kept(
        make_checkpoint, arch):
    model = str(make_checkpoint(arch))
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = [o.token_ids for o in LLM(model, dtype="float32").generate(PROMPTS, params)]
    draft = {"method": "self-int8", "num_speculative_tokens": 3}
    fast = LLM(model, dtype="float32", speculative=draft, max_num_batched_tokens=24, kv_cache_memory_bytes=1 << 20)
    assert [o.token_ids for o in fast.generate(PROMPTS, params)] == plain
    stats = fast.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0.5 * stats["spec_decode_num_draft_tokens"] > 0
    assert stats["kv_blocks_used"] == 0


def test_a_self_draft_samples_with_the_requests_uniforms_so_seeded_output_is_unchanged_and_guesses_are_kept(
        make_checkpoint):
    model = str(make_checkpoint("llama"))
    want = LLM(model, dtype="float32").generate(PROMPTS, SAMPLED)
    fast = LLM(model, dtype="float32", speculative={"method": "self-int8", "num_speculative_tokens": 3,
                                                       "disable_by_batch_size": 8})
    got = fast.generate(PROMPTS, SAMPLED)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    stats = fast.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0.3 * stats["spec_decode_num_draft_tokens"] > 0


def test_a_self_draft_of_a_model_whose_weights_are_quantized_already_is_refused(tmp_path, make_checkpoint):
    from gpu_worker.quantize.convert import quantize_checkpoint
    from services.text.errors import ModelLoadError

    quantized = tmp_path / "int8"
    quantize_checkpoint(str(make_checkpoint("llama")), "int8", quantized, 0)
    with pytest.raises(ModelLoadError, match="quantized already"):
        LLM(str(quantized), dtype="float32", speculative={"method": "self-int8", "num_speculative_tokens": 3})


def test_a_draft_model_with_its_own_cache_keeps_up_through_preemption_prefix_caching_chunked_prefill_and_n(
        make_checkpoint):
    """The target itself as its draft, but with a cache of its own: nearly every guess is kept only if the draft
    computes each token it has not seen (after kept guesses, preemptions, prefix-cache hits and forks) exactly."""
    model = str(make_checkpoint("llama"))
    plain = LLM(model, dtype="float32")
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(MIXED, MIXED_PARAMS)]
    draft = {"method": "draft", "model": model, "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    fast = LLM(model, dtype="float32", speculative=draft, **_crowded(plain, caches=2))
    assert [[c.token_ids for c in o.outputs] for o in fast.generate(MIXED, MIXED_PARAMS)] == want
    stats = fast.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0.95 * stats["spec_decode_num_draft_tokens"] > 0


def test_a_smaller_draft_model_gives_the_non_speculative_output(make_checkpoint):
    model, small = str(make_checkpoint("llama")), str(make_checkpoint("llama", num_hidden_layers=1))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = [o.token_ids for o in LLM(model, dtype="float32").generate(PROMPTS, params)]
    fast = LLM(model, dtype="float32", speculative_config={"method": "draft", "draft_model": small,
                                                           "num_speculative_tokens": 3})
    assert [o.token_ids for o in fast.generate(PROMPTS, params)] == want
    assert fast.engine.stats()["spec_decode_num_draft_tokens"] > 0


def test_a_draft_model_with_another_vocabulary_or_without_a_model_is_refused(make_checkpoint):
    from services.text.errors import ModelLoadError

    model, other = str(make_checkpoint("llama")), "smollm2-135m-instruct"  # another tokenizer
    with pytest.raises(ModelLoadError, match="tokenizer"):
        LLM(model, dtype="float32", speculative={"method": "draft", "model": other, "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="draft model"):
        LLM(model, dtype="float32", speculative={"method": "draft", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="draft model"):
        LLM(model, dtype="float32", speculative={"method": "ngram", "model": other, "num_speculative_tokens": 3})


def test_a_draft_models_own_cache_comes_out_of_the_kv_cache_budget(make_checkpoint):
    model, small = str(make_checkpoint("llama")), str(make_checkpoint("llama", num_hidden_layers=1))
    budget = 4 << 20
    plain = LLM(model, dtype="float32", kv_cache_memory_bytes=budget).engine
    fast = LLM(model, dtype="float32", kv_cache_memory_bytes=budget,
               speculative={"method": "draft", "model": small, "num_speculative_tokens": 3}).engine
    cfg = plain.model_config
    per_block = plain.kv_format.bytes_per_block(cfg.num_layers, plain.block_size, cfg.num_kv_heads, cfg.head_dim)
    # The 1-layer draft's keys and values are half the 2-layer target's: a third of the budget.
    assert fast.kv.pool.num_blocks == budget // (per_block * 3 // 2) < plain.kv.pool.num_blocks
