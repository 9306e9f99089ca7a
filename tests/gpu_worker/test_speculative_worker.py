"""A worker with n-gram speculative decoding, through the gateway with the `openai` client."""

from __future__ import annotations

import json

from gpu_worker.engine import LLM, SamplingParams
from tests.stack import MODEL, worker_metric

# A repetitive request: the prompt's n-grams give the proposer something to guess from.
MESSAGES = [{"role": "user", "content": "Say it again: red green blue, red green blue, red green blue."}]


def test_a_speculating_worker_serves_the_greedy_text_of_a_plain_engine_and_counts_its_guesses(stack):
    """...in its metrics and in the request's completion event, which the ledger records."""
    name = "small-ngram"
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    worker = stack.start_worker("--model", MODEL, "--served-model-name", name, "--speculative-config", config)
    try:
        stack.wait_for_worker(worker, name)
        reply = stack.client().chat.completions.create(model=name, messages=MESSAGES, max_tokens=32, temperature=0)
        engine = LLM(MODEL, kv_cache_memory_bytes=64 << 20)
        want = engine.generate([engine.tokenizer.apply_chat_template(MESSAGES)],
                               SamplingParams(temperature=0.0, max_tokens=32))[0]
        assert reply.choices[0].message.content == want.text
        assert reply.usage.completion_tokens == len(want.token_ids)
        status = next(s for s in stack.worker_statuses(name) if s.worker_id.endswith(f"-{worker.pid}"))
        drafted = worker_metric(status, "tokenfleet:spec_decode_num_draft_tokens_total")
        assert drafted > 0 and worker_metric(status, "tokenfleet:spec_decode_num_drafts_total") > 0
        kept_first = worker_metric(status, "tokenfleet:spec_decode_num_accepted_tokens_per_pos_total")  # position 0
        assert kept_first > 0
        usage = stack.completion_event(reply.id).usage
        assert 0 < usage.accepted_draft_tokens <= usage.draft_tokens == drafted
    finally:
        worker.terminate()
        worker.wait(60)
