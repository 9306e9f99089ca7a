"""A worker serves each model family from its HF directory, through the gateway with the `openai` client: the
reply is HF transformers' own greedy continuation of the chat prompt."""

from __future__ import annotations

from transformers import AutoTokenizer

from tests.conftest import hf_greedy

MESSAGES = [{"role": "user", "content": "Name three colours."}]
NEW_TOKENS = 12
# Qwen3 and Mixtral serve through the paths Qwen3-MoE does (per-head q/k norms, experts); their exactness is
# test_matches_hf.py's.
FAMILIES = ["qwen3-moe", "phi3", "gemma2", "gemma3", "mistral-sliding", "olmoe", "gpt-oss"]


def test_a_worker_serves_each_family_and_answers_as_hf_generates(stack, make_checkpoint):
    model_dirs = {f"family-{arch}": make_checkpoint(arch) for arch in FAMILIES}
    workers = {name: stack.start_worker("--model", str(path), "--served-model-name", name)
               for name, path in model_dirs.items()}  # started together: their start-ups overlap
    try:
        for name, worker in workers.items():
            stack.wait_for_worker(worker, name)
        assert set(workers) <= {m.id for m in stack.client().models.list().data}
        for name, model_dir in model_dirs.items():
            reply = stack.client().chat.completions.create(model=name, messages=MESSAGES, max_tokens=NEW_TOKENS,
                                                           temperature=0)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
            want = hf_greedy(model_dir, [prompt], [NEW_TOKENS])[0]
            assert (name, reply.usage.completion_tokens) == (name, NEW_TOKENS)
            assert (name, reply.choices[0].message.content) == (name, tokenizer.decode(want))
    finally:
        for worker in workers.values():
            worker.terminate()
        for worker in workers.values():
            stack.wait_stopped(worker)
