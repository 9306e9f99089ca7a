"""`LLM`: the offline, batch API (`llm.generate(prompts, params)`), as vLLM users know it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import fields

from .config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

# Tokens a step may carry when the caller does not say, on CPU: vLLM's default for its offline LLM class there,
# which favours throughput over a running request's time between tokens (its server, like our services, keeps
# 2048): fewer, larger prefill steps serve the mixed workload of `tokenfleet bench engine` a little faster than at
# 2048, and larger budgets again slower.
OFFLINE_CPU_MAX_NUM_BATCHED_TOKENS = 4096


class LLM:
    def __init__(self, model: str, **engine_kwargs):
        if "speculative_config" in engine_kwargs:  # vLLM's spelling
            engine_kwargs["speculative"] = engine_kwargs.pop("speculative_config")
        if str(engine_kwargs.get("device", EngineConfig.device)).startswith("cpu"):
            engine_kwargs.setdefault("max_num_batched_tokens", OFFLINE_CPU_MAX_NUM_BATCHED_TOKENS)
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; returns one output per prompt, in input order.

        A single prompt may be a string or a list of token ids. Bad input raises before any prompt runs.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(all_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(all_params)} sampling params")
        for prompt in prompts:
            self.engine.encode_prompt(prompt)
        order: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, all_params, strict=True)):
            request_id = f"llm-{next(self._ids)}"
            order[request_id] = i
            self.engine.add_request(request_id, prompt, p)
        results: list[RequestOutput | None] = [None] * len(prompts)
        try:
            self._run(order, all_params, results)
        except BaseException:
            for request_id in order:  # a failed step must not leave these holding KV blocks
                self.engine.abort_request(request_id)
            raise
        return results

    def _run(self, order: dict[str, int], all_params: list[SamplingParams], results: list) -> None:
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                i = order.get(delta.request_id)
                if i is None:
                    continue
                if results[i] is None:
                    results[i] = RequestOutput(delta.request_id, delta.prompt_token_ids,
                                               [CompletionOutput(k) for k in range(all_params[i].n)])
                total = results[i]
                for completion in delta.outputs:
                    total.outputs[completion.index].extend(completion)
                total.finished, total.engine_seconds = delta.finished, delta.engine_seconds
                total.num_cached_tokens, total.prompt_logprobs = delta.num_cached_tokens, delta.prompt_logprobs
                total.num_draft_tokens = delta.num_draft_tokens
                total.num_accepted_draft_tokens = delta.num_accepted_draft_tokens
