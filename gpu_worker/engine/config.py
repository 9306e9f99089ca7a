"""Engine construction parameters (the engine's own; services pass theirs in from their settings)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# Tokens per KV block where none is asked for: 128 on CPU, as vLLM's CPU backend. Decode attention reads a head's
# block as one run, and the hardware prefetcher loses each short run: 16-token blocks (2 KiB runs at 64 dims) slow
# the CPU's decode attention and the mixed workload (`python -m bench.lab.decode_parts`, `tokenfleet bench engine`).
# Prefix caching then shares whole 128-token blocks. Elsewhere 16.
DEFAULT_BLOCK_SIZE = {"cpu": 128}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int | None = None  # default: DEFAULT_BLOCK_SIZE by the device's type
    kv_cache_memory_bytes: int | None = None  # default: 1 GiB on CPU, gpu_memory_utilization on CUDA
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's positions (its sliding window, if smaller)
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes seen before
    # Weights quantized at load time (int8, int4) when the checkpoint is not quantized itself; a quantized
    # checkpoint is served as it is, with no flag (a flag naming another method is refused).
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # or int8: keys and values at 8 bits with a scale per token and head
    # Speculative decoding, vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": k, ...}.
    speculative: dict | None = None
    # Batch-invariant mode: a request's tokens do not depend on what else shares its steps (one per-row linear
    # kernel, every token attended on its own), at some cost in speed; dense bf16 weights on an AVX512-BF16 CPU.
    deterministic: bool = False
    # CUDA graphs off: decode steps launch their kernels one by one, as on CPU (vLLM's enforce_eager).
    enforce_eager: bool = False
    # The instruction sets the CPU kernels are chosen for (`kernel_choice.CPU_ISAS`): "native", this CPU's; "avx2",
    # those of a CPU with AVX2, FMA and F16C but no AVX-512, AMX or AVX-VNNI, to measure its kernels on this one.
    cpu_isa: str = "native"
    # The element-wise ops and attention by their torch references instead of the native (CPU) or Triton (CUDA)
    # kernels, the linears' kernels as chosen: what those kernels are measured against.
    torch_ops: bool = False

    def __post_init__(self) -> None:
        if self.block_size is None:
            object.__setattr__(self, "block_size", DEFAULT_BLOCK_SIZE.get(self.device.split(":")[0], 16))
