"""`prompt_logprobs=0`: each prompt token's log-probability given those before it, as HF computes it."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine import LLM, InvalidRequestError, SamplingParams
from tests.conftest import DEVICE

PROMPT = [(7 * i + 3) % 500 + 1 for i in range(70)]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("qwen2")


@pytest.fixture(scope="module")
def expected(checkpoint):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(DEVICE).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([PROMPT], device=DEVICE)).logits[0, :-1]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(PROMPT[1:], device=DEVICE)[:, None])[:, 0]


def _prompt_logprobs(llm: LLM) -> list[float | None]:
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs


@pytest.mark.parametrize("budget", [2048, 16], ids=["whole-prefill", "chunked-prefill"])
def test_prompt_logprobs_equal_hf_log_softmax_of_the_next_prompt_token(checkpoint, expected, budget):
    got = _prompt_logprobs(LLM(str(checkpoint), dtype="float32", device=DEVICE, max_num_batched_tokens=budget))
    assert got[0] is None and len(got) == len(PROMPT)
    assert torch.allclose(torch.tensor(got[1:], device=DEVICE), expected, atol=1e-4)


def test_a_request_for_prompt_logprobs_computes_a_prompt_the_prefix_cache_holds(checkpoint, expected):
    llm = LLM(str(checkpoint), dtype="float32", device=DEVICE)
    llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1))  # caches the prompt's full blocks
    got = _prompt_logprobs(llm)
    assert None not in got[1:]
    assert torch.allclose(torch.tensor(got[1:], device=DEVICE), expected, atol=1e-4)


def test_top_n_prompt_logprobs_are_refused_naming_the_field():
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(prompt_logprobs=5)
    assert err.value.param == "prompt_logprobs"
