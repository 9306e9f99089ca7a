"""Log-probabilities of a prompt's own tokens (vLLM's `prompt_logprobs=0`): what perplexity is computed from.

Position p's hidden state predicts token p + 1, so a chunk covering prompt positions [start, end) yields the
log-probabilities of prompt tokens start + 1 .. end (the last prompt position predicts the first output token,
which the sampler handles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import Transformer
from .scheduler_output import ScheduledChunk

# Rows projected to the vocabulary at once: bounds the float32 logits of a long prefill chunk.
ROWS_PER_PROJECTION = 256


@dataclass(frozen=True)
class PromptLogprobs:
    first_position: int  # the prompt position of values[0]
    values: list[float]


def scores_prompt(chunk: ScheduledChunk) -> bool:
    """Whether the chunk's rows yield prompt log-probabilities: its sequence asked for them and it covers a prompt
    position before the last."""
    return chunk.seq.params.prompt_logprobs is not None and chunk.start < chunk.seq.num_prompt_tokens - 1


def prompt_logprobs(model: Transformer, chunks: list[ScheduledChunk],
                    hidden: torch.Tensor) -> dict[int, PromptLogprobs]:
    """For each chunk (in `hidden`'s row order) of a sequence that asked for prompt log-probabilities."""
    found, row = {}, 0
    for chunk in chunks:
        seq = chunk.seq
        end = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1)
        if scores_prompt(chunk):
            targets = torch.tensor(seq.token_ids[chunk.start + 1:end + 1], device=hidden.device)
            values = []
            for lo in range(0, len(targets), ROWS_PER_PROJECTION):
                rows = hidden[row + lo:row + min(lo + ROWS_PER_PROJECTION, len(targets))]
                logprobs = torch.log_softmax(model.logits(rows).float(), dim=-1)
                values += logprobs.gather(1, targets[lo:lo + len(rows), None])[:, 0].tolist()
            found[seq.seq_id] = PromptLogprobs(chunk.start + 1, values)
        row += chunk.num_tokens
    return found
