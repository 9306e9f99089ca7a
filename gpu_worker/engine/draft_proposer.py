"""A draft model proposes guesses by running ahead of the target, all guessing sequences in one batch per draft
step: a smaller checkpoint with the target's tokenizer (`draft`), or the target's own weights quantized to int8 or
int4 (`self-int8`, `self-int4`).

A self-draft has the target's layers and heads, so it reads the target's own KV cache: the context it attends to
is the target's exact keys and values, and nothing has to catch up after a rejection. It writes keys and values
only into the slots the step holds for the sequence's last token and its guesses, which the target's verifying
step overwrites before anything reads them.

A separate draft model has a KV cache of its own, indexed by the target's block tables (same blocks, same
slots). It first computes the tokens it has not seen (`Sequence.num_draft_computed_tokens` up to the last one:
the whole prompt the first time, the kept guesses and the model's token after a step), in the same forward as
the other sequences' draft steps; a sequence further behind than a step's token budget catches up by that many
tokens a step, without guesses, as the target's chunked prefill does.

Each draft token is sampled as the target samples (the request's penalties, temperature and filters, and the
uniform of that output position): where the two distributions are close, the same uniform picks the same token,
so sampled requests keep guesses too, and the verifier stays exact whatever the draft proposes.
"""

from __future__ import annotations

from dataclasses import replace

from .model_runner import ModelRunner
from .scheduler_output import ScheduledChunk, SchedulerOutput
from .sequence import Sequence
from .speculative import Proposer, SpeculativeConfig


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, shares_target_cache: bool,
                 max_catch_up_tokens: int):
        super().__init__(config.num_speculative_tokens, config.disable_by_batch_size)
        self.runner, self.shares_target_cache = runner, shares_target_cache
        self.max_catch_up_tokens = max_catch_up_tokens

    def propose(self, chunks: list[ScheduledChunk]) -> list[list[int]]:
        guesses: list[list[int]] = [[] for _ in chunks]
        behind = {i for i, c in enumerate(chunks) if self._unseen(c) > self.max_catch_up_tokens}
        catch_up = [ScheduledChunk(_with_guesses(chunks[i].seq, []), chunks[i].seq.num_draft_computed_tokens,
                                   self.max_catch_up_tokens, chunks[i].block_tables, sample=False) for i in behind]
        for step in range(max(c.max_guesses for c in chunks)):
            active = [i for i, c in enumerate(chunks) if c.max_guesses > step and i not in behind]
            drafts = [self._draft_chunk(chunks[i], guesses[i]) for i in active]
            if not drafts and not catch_up:
                break
            sampled, _ = self.runner.execute(SchedulerOutput(drafts + catch_up))  # catching up: first step only
            catch_up = []
            for i, draft in zip(active, drafts, strict=True):
                guesses[i].append(sampled[draft.seq.seq_id][0].token_id)
        if not self.shares_target_cache:
            for i, chunk in enumerate(chunks):  # its KV now covers the last token and every guess but the last
                seq = chunk.seq
                seq.num_draft_computed_tokens = (seq.num_draft_computed_tokens + self.max_catch_up_tokens
                                                 if i in behind else chunk.start + chunk.max_guesses)
        return guesses

    def _unseen(self, chunk: ScheduledChunk) -> int:
        """Tokens up to and including the chunk's last that the draft has no KV for."""
        return 0 if self.shares_target_cache else chunk.start + 1 - chunk.seq.num_draft_computed_tokens

    def _draft_chunk(self, chunk: ScheduledChunk, guesses: list[int]) -> ScheduledChunk:
        """The draft's tokens for `chunk` this draft step: its last token (with a cache of its own, from the
        first it has not seen), then one guess at a time."""
        position = chunk.start + len(guesses)
        start = position if guesses or self.shares_target_cache else chunk.seq.num_draft_computed_tokens
        return ScheduledChunk(_with_guesses(chunk.seq, guesses), start, position + 1 - start, chunk.block_tables,
                              sample=True)


def _with_guesses(seq: Sequence, guesses: list[int]) -> Sequence:
    """The sequence as if its guesses were output already, sampling its next token without log-probabilities."""
    params = seq.params
    if params.logprobs is not None or params.prompt_logprobs is not None:
        params = replace(params, logprobs=None, prompt_logprobs=None)
    return replace(seq, token_ids=seq.token_ids + guesses, params=params, forks_pending=[])
