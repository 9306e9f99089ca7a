"""A draft model proposes guesses by running ahead of the target: a cheaper copy of the target (its own weights
quantized to int8 or int4) decodes the next tokens of every guessing sequence, all of them in one batch per
draft step.

The self-draft has the target's layers and heads, so it reads the target's own KV cache: the context the draft
attends to is the target's exact keys and values, and nothing has to catch up after a rejection. The draft
writes its keys and values only into the slots the step holds for the sequence's last token and its guesses,
which the target's verifying step overwrites before anything reads them.

Each draft token is sampled as the target samples (the request's penalties, temperature and filters, and the
uniform of that output position): where the two distributions are close, the same uniform picks the same
token, so sampled requests keep most guesses too, and the verifier stays exact whatever the draft proposes.
"""

from __future__ import annotations

from dataclasses import replace

from .model_runner import ModelRunner
from .scheduler import ScheduledChunk, SchedulerOutput
from .sequence import Sequence
from .speculative import Proposer, SpeculativeConfig


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner):
        super().__init__(config.num_speculative_tokens, config.disable_by_batch_size)
        self.runner = runner

    def propose(self, chunks: list[ScheduledChunk]) -> list[list[int]]:
        guesses: list[list[int]] = [[] for _ in chunks]
        for step in range(max(c.max_guesses for c in chunks)):
            active = [i for i, c in enumerate(chunks) if c.max_guesses > step]
            # Step `step` feeds each sequence's token at position start + step (its last, then its guesses).
            drafts = [ScheduledChunk(_with_guesses(chunks[i].seq, guesses[i]), chunks[i].start + step, 1,
                                     chunks[i].block_table, sample=True) for i in active]
            sampled, _ = self.runner.execute(SchedulerOutput(drafts))
            for i, draft in zip(active, drafts, strict=True):
                guesses[i].append(sampled[draft.seq.seq_id][0].token_id)
        return guesses


def _with_guesses(seq: Sequence, guesses: list[int]) -> Sequence:
    """The sequence as if its guesses were output already, sampling its next token without log-probabilities."""
    params = seq.params
    if params.logprobs is not None or params.prompt_logprobs is not None:
        params = replace(params, logprobs=None, prompt_logprobs=None)
    return replace(seq, token_ids=seq.token_ids + guesses, params=params, forks_pending=[])
