"""`LLMEngine`: requests in, token deltas out, one `step()` at a time."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass

import torch

from services.text.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequestError, ModelLoadError

from .checkpoint import Checkpoint, open_checkpoint
from .config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from .cuda_graphs import DecodeGraphs
from .detokenizer import IncrementalDetokenizer
from .draft_proposer import DraftModelProposer
from .host_memory import keep_freed_memory
from .kernel_choice import choose_kernels, kernel_summary
from .kv_cache_groups import KVCacheLayout
from .kv_cache_manager import KVCacheManager, cdiv
from .linear import Linear
from .loader import load_model
from .memory_profile import kv_cache_budget
from .model import Transformer
from .model_config import ModelConfig, resolve_dtype, resolve_max_model_len
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestOutput
from .prompt_logprobs import PromptLogprobs
from .quantization.methods import WeightQuantizer, load_time_quantizer
from .sampler import SampledToken
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .scheduler_output import SchedulerOutput
from .sequence import ResumedChoice, Sequence
from .speculative import NgramProposer, NoProposer, Proposer, SpeculationStats, SpeculativeConfig

log = logging.getLogger(__name__)

# Prompt tokens the detokenizer decodes as context before the first output token (vLLM uses 5).
DETOKENIZER_CONTEXT = 5


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detokenizers: dict[int, IncrementalDetokenizer]  # by sample index
    arrival_time: float
    first_token_time: float | None = None
    engine_seconds: float = 0.0  # this request's share of measured step time, by tokens processed
    prompt_logprobs: list[float | None] | None = None  # when asked for: entry 0 is None (nothing predicts it)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def step_shares(out: SchedulerOutput, elapsed: float) -> dict[str, float]:
    """Each request's share of one step's wall time, in proportion to the tokens computed for it in the step
    (a prefill chunk's many, a decode's one): the shares sum to the step's time. This is what the ledger
    prices as a task's GPU-seconds."""
    total = out.num_tokens
    shares: dict[str, float] = {}
    for chunk in out.chunks:
        shares[chunk.seq.group_id] = shares.get(chunk.seq.group_id, 0.0) + elapsed * chunk.num_tokens / total
    return shares


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        checkpoint = open_checkpoint(config.model)
        self.model_path, self.model_config = checkpoint.path, checkpoint.config
        self.dtype = resolve_dtype(config.dtype, self.model_config.checkpoint_dtype, self.device)
        self.max_model_len = resolve_max_model_len(self.model_config, config.max_model_len)
        self.tokenizer = checkpoint.tokenizer()
        self.eos_token_ids = self.model_config.eos_token_ids | self.tokenizer.eos_token_ids
        quantizer = load_time_quantizer(config.quantization, checkpoint.quantization, self.device)
        self.kernels = choose_kernels(config, self.dtype)
        self.kv_format = self.kernels.kv_format
        model = load_model(checkpoint, self.kernels, quantizer)
        # A window no sequence outgrows frees nothing: such layers are grouped as full attention (as vLLM does).
        self.kv_layout = KVCacheLayout.of_windows([
            w if w is not None and w < self.max_model_len else None
            for w in map(self.model_config.window_of, range(self.model_config.num_layers))])
        speculative = SpeculativeConfig.parse(config.speculative)
        draft = self._load_draft(speculative, checkpoint, model)
        graphs = self.kernels.decode_graphs and model.graph_capturable
        cfg = self.model_config
        num_blocks = self._num_blocks(model, draft.config if speculative and speculative.method == "draft" else None,
                                      config.max_num_seqs if graphs else 0)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, self.kv_layout.windows)
        # With CUDA graphs, one block more than the pool hands out: the padding rows' (`cuda_graphs.py`).
        slots = self.kv_format.allocate(self.kv_layout.num_slots, num_blocks + graphs, config.block_size,
                                        cfg.num_kv_heads, cfg.head_dim, self.device)
        kv_caches = self.kv_layout.caches_by_layer(slots)
        self.runner = ModelRunner(model, kv_caches, config.block_size, self.device, config.deterministic,
                                  self._decode_graphs(model, kv_caches, num_blocks) if graphs else None,
                                  self.kv_layout.group_of_layer)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len), self.kv,
            self._proposer(speculative, draft),
        )
        log.info("%s: %s weights%s, KV cache %s: %d blocks of %d tokens in %d group(s) of layers", self.model_path,
                 self.dtype, f" quantized ({quantizer.method} at load)" if quantizer else
                 f" quantized ({checkpoint.quantization.name})" if checkpoint.quantization else "",
                 self.kv_format.name, num_blocks, config.block_size, len(self.kv_layout.groups))
        log.info("kernels: %s", kernel_summary(model, self.kernels))
        self.requests: dict[str, RequestState] = {}
        self.busy_seconds = 0.0
        self._seq_counter = 0
        self._entropy = random.SystemRandom()
        if self.device.type == "cpu":
            keep_freed_memory()

    def _load_draft(self, config: SpeculativeConfig | None, checkpoint: Checkpoint,
                    target: Transformer) -> Transformer | None:
        """The draft model's weights, loaded before the KV cache is sized from the memory left (or None), on the
        target's kernels, never batch-invariant ones."""
        if config is None or config.method == "ngram":
            return None
        kernels = choose_kernels(dataclasses.replace(self.config, deterministic=False), self.dtype)
        if config.method == "draft":  # a smaller model with the target's tokenizer
            draft = open_checkpoint(config.model)
            vocab, probe = draft.config.vocab_size, "Draft models must split text as the target does: 3.14 über 日本"
            if vocab != self.model_config.vocab_size or draft.tokenizer().encode(probe) != self.tokenizer.encode(probe):
                raise ModelLoadError(f"draft model {draft.path} does not share the target's tokenizer "
                                     f"(vocabulary {vocab}, the target's {self.model_config.vocab_size})")
            # The draft's layers read the target's first group's tables, from the first token it has not seen: they
            # must keep every block (a target with a full-attention layer).
            if self.kv_layout.groups[0].window is not None:
                raise ModelLoadError(f"a separate draft model needs a target with full-attention layers; every layer "
                                     f"of {self.model_path} slides (its blocks out of the window are freed): use "
                                     "ngram or a self-draft method")
            return load_model(draft, kernels)
        if not any(isinstance(m, Linear) and m.weight is not None for m in target.modules()):
            raise ModelLoadError(f"speculative method {config.method} drafts with the target's dense weights "
                                 "quantized; this model's are quantized already (the draft would be the model "
                                 "itself): serve a dense checkpoint, or use another method")
        return load_model(checkpoint, kernels, WeightQuantizer(config.self_draft_quantization))

    def _proposer(self, config: SpeculativeConfig | None, draft: Transformer | None) -> Proposer:
        if config is None:
            return NoProposer()
        if config.method == "ngram":
            return NgramProposer(config)
        if config.method != "draft":  # a self-draft reads the target's own cache
            runner = ModelRunner(draft, self.runner.kv_caches, self.kv.block_size, self.device,
                                 layer_groups=self.runner.layer_groups)
            return DraftModelProposer(config, runner, shares_target_cache=True, max_catch_up_tokens=0)
        cfg = draft.config
        caches = self.kv_format.allocate(cfg.num_layers, self.kv.pool.num_blocks, self.kv.block_size,
                                         cfg.num_kv_heads, cfg.head_dim, self.device)
        return DraftModelProposer(config, ModelRunner(draft, caches, self.kv.block_size, self.device),
                                  shares_target_cache=False, max_catch_up_tokens=self.config.max_num_batched_tokens)

    def _decode_graphs(self, model: Transformer, kv_caches: list, padding_block: int) -> DecodeGraphs:
        bs = self.config.block_size
        graphs = DecodeGraphs(model, kv_caches, self.kv_layout.group_of_layer, bs, self.config.max_num_seqs,
                              cdiv(self.max_model_len, bs) + 1, padding_block, self.device)
        graphs.capture_all()
        return graphs

    def _num_blocks(self, model: Transformer, draft: ModelConfig | None, graph_rows: int) -> int:
        """As many blocks as the budget holds, each with the target's keys and values in its KV-cache layout's
        slots (every layer's, for a model of one group), and a draft model's, when it has a cache of its own over
        the same blocks. On CUDA the budget is what gpu_memory_utilization leaves after the weights, a full step's
        activations (measured) and CUDA graphs."""
        per_block = sum(self.kv_format.bytes_per_block(layers, self.config.block_size, cfg.num_kv_heads, cfg.head_dim)
                        for cfg, layers in ((self.model_config, self.kv_layout.num_slots),
                                            (draft, draft and draft.num_layers)) if cfg)
        budget = self.config.kv_cache_memory_bytes
        if budget is None and self.device.type == "cuda":
            budget = kv_cache_budget(model, self.kv_format, self.config.block_size,
                                     self.config.max_num_batched_tokens, self.max_model_len,
                                     self.config.max_num_seqs, graph_rows, self.config.gpu_memory_utilization,
                                     self.device)
        num_blocks = (DEFAULT_CPU_KV_CACHE_BYTES if budget is None else budget) // per_block
        needed = self.kv_layout.blocks_for(self.max_model_len, self.config.block_size,
                                           self.config.max_num_batched_tokens)
        if num_blocks < needed:
            raise ValueError(
                f"KV cache of {num_blocks} blocks of {self.config.block_size} tokens is less than the {needed} a "
                f"sequence of max_model_len {self.max_model_len} needs: raise kv_cache_memory_bytes or lower "
                "max_model_len"
            )
        return num_blocks

    # ---- requests -------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens "
                "and at least one must be left for the completion", "prompt", CONTEXT_LENGTH_EXCEEDED)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab})", "prompt")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, resume: list[ResumedChoice] | None = None,
                    cache_salt: str | None = None) -> None:
        """`resume`: continue these samples (only these) from the tokens they already produced.
        `cache_salt`: prefix-cache hits only among requests with the same salt (a tenant's own prompts)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running", "request_id")
        prompt_ids = self.encode_prompt(prompt)
        if resume is None:
            seqs = [self._new_sequence(request_id, i, prompt_ids, params, priority, cache_salt)
                    for i in range(params.n)]
            seqs[0].forks_pending = seqs[1:]
            queued = seqs[:1]
        else:  # each sample has its own tokens past the prompt: nothing to fork
            seqs = [self._new_sequence(request_id, c.index, prompt_ids, params, priority, cache_salt) for c in resume]
            queued = seqs
        detokenizers = {s.index: IncrementalDetokenizer(self.tokenizer, params.stop,
                                                        prompt_ids[-DETOKENIZER_CONTEXT:]) for s in seqs}
        for seq, choice in zip(seqs, resume or [], strict=False):
            seq.token_ids.extend(choice.token_ids)
            detokenizers[seq.index].skip(choice.token_ids, choice.text_emitted)
        self.requests[request_id] = RequestState(
            request_id, prompt_ids, seqs, detokenizers, arrival_time=time.perf_counter(),
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(prompt_ids))
        for seq in queued:
            self.scheduler.add(seq)

    def _new_sequence(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams,
                      priority: int, cache_salt: str | None) -> Sequence:
        self._seq_counter += 1
        seed = (params.seed * 1_000_003 + index) if params.seed is not None else self._entropy.getrandbits(63)
        return Sequence(self._seq_counter, request_id, index, list(prompt_ids), len(prompt_ids), params,
                        seed=seed, priority=priority, arrival=self._seq_counter, cache_salt=cache_salt)

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for seq in state.seqs:
                self.scheduler.abort(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- stepping -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()  # a draft model's forwards run while scheduling: they are the step's too
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("no waiting request fits the free KV blocks and none is running")
            return []
        sampled, prompt_logprobs = self.runner.execute(out)
        elapsed = time.perf_counter() - started
        self._record_prompt_logprobs(out, prompt_logprobs)
        taken = self.scheduler.update(out, {k: [t.token_id for t in v] for k, v in sampled.items()},
                                      self.eos_token_ids)
        self._attribute_step_time(out, elapsed)
        outputs = self._process_samples(out, {k: v[:taken[k]] for k, v in sampled.items()})
        self.scheduler.release_finished()
        return outputs

    def _record_prompt_logprobs(self, out: SchedulerOutput, found: dict[int, PromptLogprobs]) -> None:
        for chunk in out.chunks:
            if (part := found.get(chunk.seq.seq_id)) is not None:
                logprobs = self.requests[chunk.seq.group_id].prompt_logprobs
                logprobs[part.first_position:part.first_position + len(part.values)] = part.values

    def _attribute_step_time(self, out: SchedulerOutput, elapsed: float) -> None:
        self.busy_seconds += elapsed
        for group_id, seconds in step_shares(out, elapsed).items():
            if (state := self.requests.get(group_id)) is not None:
                state.engine_seconds += seconds

    def _process_samples(self, out: SchedulerOutput, sampled: dict[int, list[SampledToken]]) -> list[RequestOutput]:
        now = time.perf_counter()
        deltas: dict[str, list[CompletionOutput]] = {}
        for chunk in out.chunks:
            seq, tokens = chunk.seq, sampled.get(chunk.seq.seq_id)
            if tokens is None:
                continue
            state = self.requests[seq.group_id]
            state.first_token_time = state.first_token_time or now
            detok = state.detokenizers[seq.index]
            # Up to a stop string: nothing after a stop is emitted or billed.
            for i, token in enumerate(tokens):
                if (stop := detok.add_token(token.token_id)) is not None:
                    seq.finish("stop", stop)
                    del seq.token_ids[seq.num_tokens - len(tokens) + i + 1:]
                    tokens = tokens[:i + 1]
                    break
            deltas.setdefault(state.request_id, []).append(CompletionOutput(
                seq.index, detok.take_delta(seq.is_finished), [t.token_id for t in tokens], seq.finish_reason,
                seq.stop_reason, None if tokens[0].logprobs is None else [t.logprobs for t in tokens],
            ))
        results = []
        for request_id, completions in deltas.items():
            state = self.requests[request_id]
            if state.finished:
                del self.requests[request_id]
            results.append(RequestOutput(request_id, state.prompt_token_ids, completions, state.finished,
                                         state.engine_seconds, max(s.num_cached_tokens for s in state.seqs),
                                         state.prompt_logprobs, sum(s.num_guessed_tokens for s in state.seqs),
                                         sum(s.num_kept_guesses for s in state.seqs)))
        return results

    # ---- introspection --------------------------------------------------------------------------------

    def drain_kv_events(self, resend_all: bool = False) -> tuple[list[tuple[bool, int]], list[int] | None]:
        """Prefix-cache changes since the last call, for the prefix directory: ([(added, block hash)], None),
        or ([], every cached block hash) when events were lost (or `resend_all`: the receiver missed some)
        and the receiver must replace what it knows. Safe to call while a step runs in the engine's thread."""
        events, overflowed = self.kv.pool.events.drain()
        return ([], self.kv.pool.cached_hashes()) if overflowed or resend_all else (events, None)

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def stats(self) -> dict[str, float]:
        pool = self.kv.pool
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used,
            "kv_cache_usage": pool.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.kv.num_queried_tokens,  # tokens, as vLLM counts them
            "prefix_cache_hits": self.kv.num_hit_tokens,
            "busy_seconds": self.busy_seconds,  # wall time of every step so far: what the requests' shares sum to
            "spec_decode_num_drafts": self.speculation.num_drafts,  # vLLM's names
            "spec_decode_num_draft_tokens": self.speculation.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.speculation.num_accepted_tokens,
        }

    @property
    def speculation(self) -> SpeculationStats:
        return self.scheduler.speculation
