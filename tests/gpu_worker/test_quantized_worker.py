"""A worker serving quantized weights and an int8 KV cache, through the gateway with the `openai` client."""

from __future__ import annotations

from gpu_worker.engine import LLM, SamplingParams
from gpu_worker.quantize.convert import quantize_checkpoint
from tests.stack import MODEL

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_a_quantized_directory_with_an_int8_kv_cache_serves_what_the_engine_serves(stack, tmp_path):
    served = quantize_checkpoint(MODEL, "int8", tmp_path / "small-int8").out
    name = "small-int8-kv8"
    worker = stack.start_worker("--model", str(served), "--served-model-name", name, "--kv-cache-dtype", "int8")
    try:
        stack.wait_for_worker(worker, name)
        reply = stack.client().chat.completions.create(model=name, messages=MESSAGES, max_tokens=16, temperature=0)
        engine = LLM(str(served), dtype="float32", kv_cache_dtype="int8", kv_cache_memory_bytes=64 << 20)
        want = engine.generate([engine.tokenizer.apply_chat_template(MESSAGES)],
                               SamplingParams(temperature=0.0, max_tokens=16))[0]
        assert reply.choices[0].message.content == want.text
        assert reply.usage.completion_tokens == len(want.token_ids)
        assert name in {m.id for m in stack.client().models.list().data}
    finally:
        worker.terminate()
        stack.wait_stopped(worker)
