"""Executes one scheduled step: the only place that builds tensors and runs the model and the sampler."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .attention import AttentionMetadata, PrefillChunk
from .cuda_graphs import DecodeGraphs, NoDecodeGraphs
from .host_memory import to_device
from .kv_cache_manager import cdiv
from .model import Transformer
from .prompt_logprobs import PromptLogprobs, prompt_logprobs, scores_prompt
from .sampler import SampledToken, Sampler, SamplingBatch, position_uniform
from .scheduler_output import ScheduledChunk, SchedulerOutput
from .speculative import accepted_prefix


class ModelRunner:
    def __init__(self, model: Transformer, kv_caches: list, block_size: int, device: torch.device,
                 batch_invariant: bool = False, graphs: DecodeGraphs | NoDecodeGraphs | None = None,
                 layer_groups: list[int] | None = None):
        """`layer_groups`: the KV-cache group whose block tables each layer reads (`kv_cache_groups.py`); None:
        the first group's, in every layer."""
        self.model = model
        self.forward = model.bound()  # the model's forward with its calls bound (no module's hooks run)
        self.graphs = graphs or NoDecodeGraphs()
        self.device = device
        self.block_size = block_size
        self.kv_caches = kv_caches  # each layer's: its KV-cache slot's tensor (`kv_cache_groups.py`)
        self.layer_groups = layer_groups or [0] * len(kv_caches)
        self.num_groups = max(self.layer_groups) + 1
        self.sampler = Sampler(model.ops)
        # The chunks attended as decode rows, each token on its own over its context: decode steps; in
        # batch-invariant mode (a model loaded so) every chunk, so that no token's attention depends on where its
        # prompt's chunks start and end, which the step's shared token budget decides (nor on a prefix-cache hit,
        # or a recompute after preemption): a token then runs the same ops whatever else its step holds.
        self.attends_by_row = _every_chunk if batch_invariant else _decodes

    @contextlib.contextmanager
    def through_modules(self) -> Iterator[None]:
        """Steps through the model's modules meanwhile, so that hooks registered on them run (calibration, tests)."""
        bound, self.forward = self.forward, self.model
        try:
            yield
        finally:
            self.forward = bound

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[dict[int, list[SampledToken]], dict[int, PromptLogprobs]]:
        """The tokens sampled for each sequence whose chunk ends in a sample (one, or with guesses those kept and
        the model's next), and the prompt log-probabilities of the chunks that asked for them, by sequence id."""
        # Decode tokens first, shortest context first: attended in groups; then prefill chunks one by one.
        chunks = sorted(out.chunks, key=lambda c: (not self.attends_by_row(c), c.start))
        input_ids, positions, metas = self.prepare(chunks)
        sample_rows = _sample_rows(chunks)
        if self.graphs.covers(metas):
            hidden = self.graphs.run(input_ids, positions, metas)
        elif len(sample_rows) == len(input_ids) or any(map(scores_prompt, chunks)):
            hidden = self.forward(input_ids, positions, self.kv_caches, self.by_layer(metas))
        else:  # the sampled rows' final hidden states alone; a step sampling none keeps one (kernels take no
            # empty batch) and discards it
            rows = to_device(sample_rows or [len(input_ids) - 1], torch.long, self.device)
            hidden = self.forward(input_ids, positions, self.kv_caches, self.by_layer(metas), rows)
        return self._sample(chunks, hidden, sample_rows), prompt_logprobs(self.model, chunks, hidden)

    def _sample(self, chunks: list[ScheduledChunk], hidden: torch.Tensor,
                sample_rows: list[int]) -> dict[int, list[SampledToken]]:
        """hidden: every row's final hidden state, or the sampled rows' alone."""
        sampled_chunks = [c for c in chunks if c.sample]
        if not sampled_chunks:
            return {}
        if len(sample_rows) < len(hidden):
            hidden = hidden[to_device(sample_rows, torch.long, self.device)]
        logits = self.model.logits(hidden)
        rows = [(c, i) for c in sampled_chunks for i in range(len(c.guesses) + 1)]
        tokens = iter(self.sampler(logits, _sampling_batch(rows)))
        out = {}
        for c in sampled_chunks:
            choices = [next(tokens) for _ in range(len(c.guesses) + 1)]
            if c.guesses:
                kept = accepted_prefix(c.guesses, [t.token_id for t in choices])
                choices = choices[:len(kept)]
            out[c.seq.seq_id] = choices
        return out

    def by_layer(self, metas: list[AttentionMetadata]) -> list[AttentionMetadata]:
        """Each layer's metadata: its KV-cache group's."""
        return [metas[g] for g in self.layer_groups]

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
        """The step's token ids, positions and attention metadata, one per KV-cache group the layers read."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        decodes = [c for c in chunks if self.attends_by_row(c)]
        for c in chunks:
            ids.extend(c.token_ids)
            pos.extend(range(c.start, c.start + c.num_tokens))
        dev = self.device
        positions = to_device(pos, torch.long, dev)
        offsets = positions % bs
        # A chunk with guesses is decode rows too, one per token, each seeing the context up to itself: all of
        # the step's keys are written before attention reads them.
        context_lens = [c.start + 1 + i for c in decodes for i in range(c.num_tokens)]
        decode_lens = to_device(context_lens, torch.long, dev) if decodes else None
        metas = []
        for g in range(self.num_groups):
            blocks = [c.block_tables[g][p // bs] for c in chunks for p in range(c.start, c.start + c.num_tokens)]
            meta = AttentionMetadata(to_device(blocks, torch.long, dev), offsets, bs, context_lens, None, decode_lens,
                                     [])
            if decodes:
                width = max(len(c.block_tables[g]) for c in decodes)
                meta.decode_block_tables = to_device([c.block_tables[g] + [0] * (width - len(c.block_tables[g]))
                                                      for c in decodes for _ in range(c.num_tokens)], torch.long, dev)
            start = len(context_lens)
            for c in chunks[len(decodes):]:
                ctx = c.start + c.num_tokens
                table = to_device(c.block_tables[g][: cdiv(ctx, bs)], torch.long, dev)
                meta.prefills.append(PrefillChunk(start, c.num_tokens, ctx, table))
                start += c.num_tokens
            metas.append(meta)
        return to_device(ids, torch.long, dev), positions, metas


def _sample_rows(chunks: list[ScheduledChunk]) -> list[int]:
    """The rows of the step whose next token is sampled: each sampling chunk's last, and with guesses the rows
    scoring them."""
    rows, row = [], 0
    for chunk in chunks:
        row += chunk.num_tokens
        if chunk.sample:
            rows.extend(range(row - 1 - len(chunk.guesses), row))
    return rows


def _decodes(chunk: ScheduledChunk) -> bool:
    """A decode step's chunk: one token, or its last token and the guesses after it."""
    return chunk.num_tokens == 1 or bool(chunk.guesses)


def _every_chunk(chunk: ScheduledChunk) -> bool:
    return True


def _sampling_batch(rows: list[tuple[ScheduledChunk, int]]) -> SamplingBatch:
    """Row (chunk, i) samples the sequence's output position num_output_tokens + i, as if its first i guesses
    were already output: with that position's uniform, and with them counted by its penalties."""
    # Token lists are only needed, and only copied, for rows that apply penalties.
    penalized = [c.seq.params.has_penalties for c, _ in rows]
    return SamplingBatch(
        params=[c.seq.params for c, _ in rows],
        uniforms=[position_uniform(c.seq.seed, c.seq.num_output_tokens + i) for c, i in rows],
        prompt_token_ids=[c.seq.token_ids[: c.seq.num_prompt_tokens] if p else []
                          for (c, _), p in zip(rows, penalized, strict=True)],
        output_token_ids=[c.seq.output_token_ids + c.guesses[:i] if p else []
                          for (c, i), p in zip(rows, penalized, strict=True)],
    )
