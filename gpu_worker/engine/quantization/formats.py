"""Pre-quantized checkpoint formats: which tensors hold a quantized linear and how they map to our weights.

The format is read from the checkpoint's metadata (config.json's `quantization_config`, or the legacy
`quantize_config.json` beside it), never guessed from file names. Each format turns the tensors of one
module (`<module>.qweight`, `.scales`, ...) into the canonical `Int8Weight` / `Int4Weight`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from services.text.errors import ModelLoadError

from .weights import Int4Weight, Int8Weight, QuantizedWeight, pack_nibbles

# AutoAWQ packs output column 8c + AWQ_ORDER[i] into nibble i of word c; reading undoes it.
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
KERNEL_GROUP_SIZES = (32, 64, 128, 256)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> [..., W, 8] values 0..15, nibble i (low bits first) in position i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return (words.to(torch.int32)[..., None] >> shifts) & 0xF


@dataclass(frozen=True)
class TokenfleetFormat:
    """What `tokenfleet quantize` writes, per module: int8 — qweight int8 [N, K] and scales [N]; int4 — qweight
    uint8 [N, K/2] (input 2i in the low nibble), scales and offsets [N, K/G] with w = q * scale + offset.
    Each weight's kind and group size are read from its tensors (an int4 file may hold int8 weights whose
    input size no int4 group divides)."""

    bits: int
    group_size: int | None = None
    name = "tokenfleet"

    def tensor_names(self) -> tuple[str, ...]:
        return ("qweight", "scales", "offsets")

    def required_names(self, found: dict[str, torch.Tensor]) -> tuple[str, ...]:
        int8 = "qweight" in found and found["qweight"].dtype == torch.int8
        return ("qweight", "scales") if int8 else ("qweight", "scales", "offsets")

    def read(self, t: dict[str, torch.Tensor]) -> QuantizedWeight:
        if t["qweight"].dtype == torch.int8:
            return Int8Weight(t["qweight"], t["scales"].float())
        group = 2 * t["qweight"].shape[1] // t["scales"].shape[1]
        return Int4Weight(t["qweight"].to(torch.uint8), t["scales"].float(), t["offsets"].float(), group)

    def write(self, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
        if isinstance(weight, Int8Weight):
            return {"qweight": weight.q, "scales": weight.scale.to(torch.bfloat16)}
        return {"qweight": weight.packed, "scales": weight.scale.to(torch.bfloat16),
                "offsets": weight.offset.to(torch.bfloat16)}

    def quantization_config(self) -> dict:
        return {"quant_method": self.name, "bits": self.bits, "group_size": self.group_size}


@dataclass(frozen=True)
class GptqFormat:
    """GPTQ (AutoGPTQ / GPTQModel): qweight int32 [K/8, N] packed along K, qzeros int32 [K/G, N/8] along N,
    scales [K/G, N], g_idx [K]; w = s * (q - (z + 1)), or s * (q - z) in the gptq_v2 format."""

    group_size: int
    v2: bool = False
    name = "gptq"

    def tensor_names(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx")

    def required_names(self, found: dict[str, torch.Tensor]) -> tuple[str, ...]:
        return self.tensor_names()

    def read(self, t: dict[str, torch.Tensor]) -> QuantizedWeight:
        q = _nibbles(t["qweight"]).permute(0, 2, 1).reshape(-1, t["qweight"].shape[1]).T  # [N, K]
        zeros = _nibbles(t["qzeros"]).flatten(-2).T.float() + (0 if self.v2 else 1)  # [N, K/G]
        scale = t["scales"].T.float()
        n, k = q.shape
        g_idx = t["g_idx"].long()
        perm = None
        if not torch.equal(g_idx, torch.arange(k, device=g_idx.device) // self.group_size):  # act-order
            counts = torch.bincount(g_idx, minlength=k // self.group_size)
            if counts.numel() != k // self.group_size or bool((counts != self.group_size).any()):
                raise ModelLoadError("GPTQ g_idx does not assign group_size inputs to each group: unsupported")
            perm = torch.argsort(g_idx, stable=True)
            q = q[:, perm]
        return Int4Weight(pack_nibbles(q), scale, -scale * zeros, self.group_size, perm)


@dataclass(frozen=True)
class AwqFormat:
    """AWQ GEMM (AutoAWQ): qweight int32 [K, N/8] and qzeros int32 [K/G, N/8] packed along N in AutoAWQ's
    interleaved order, scales [K/G, N]; w = s * (q - z)."""

    group_size: int
    name = "awq"

    def tensor_names(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    def required_names(self, found: dict[str, torch.Tensor]) -> tuple[str, ...]:
        return self.tensor_names()

    def read(self, t: dict[str, torch.Tensor]) -> QuantizedWeight:
        q = _nibbles(t["qweight"])[..., AWQ_REVERSE_ORDER].flatten(-2).T  # [N, K]
        zeros = _nibbles(t["qzeros"])[..., AWQ_REVERSE_ORDER].flatten(-2).T.float()
        scale = t["scales"].T.float()
        return Int4Weight(pack_nibbles(q), scale, -scale * zeros, self.group_size)


CheckpointFormat = TokenfleetFormat | GptqFormat | AwqFormat


class _Refusal:
    def __init__(self, model_dir: Path, method: str):
        self.where = f"{model_dir}: {method or 'unnamed'} quantization"

    def __call__(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.where} with {what} is not supported")


def _group_size(raw: dict, refuse: _Refusal) -> int:
    group = raw.get("group_size")
    if group not in KERNEL_GROUP_SIZES:
        raise refuse(f"group_size={group} (supported: {', '.join(map(str, KERNEL_GROUP_SIZES))})")
    return group


def _tokenfleet(raw: dict, refuse: _Refusal) -> TokenfleetFormat:
    bits = raw.get("bits")
    if bits not in (4, 8):
        raise refuse(f"bits={bits} (supported: 4, 8)")
    return TokenfleetFormat(bits, _group_size(raw, refuse) if bits == 4 else None)


def _gptq(raw: dict, refuse: _Refusal) -> GptqFormat:
    if raw.get("bits") != 4:
        raise refuse(f"bits={raw.get('bits')} (only 4-bit)")
    layout = raw.get("checkpoint_format", raw.get("format", "gptq"))
    if layout not in ("gptq", "gptq_v2"):
        raise refuse(f"checkpoint_format={layout!r} (supported: gptq, gptq_v2)")
    return GptqFormat(_group_size(raw, refuse), v2=layout == "gptq_v2")


def _awq(raw: dict, refuse: _Refusal) -> AwqFormat:
    if raw.get("bits") != 4:
        raise refuse(f"bits={raw.get('bits')} (only 4-bit)")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm" or raw.get("zero_point") is False:
        raise refuse(f"version={version}, zero_point={raw.get('zero_point')} (only the GEMM layout with zero points)")
    return AwqFormat(_group_size(raw, refuse))


_READERS = {TokenfleetFormat.name: _tokenfleet, GptqFormat.name: _gptq, AwqFormat.name: _awq}


def read_checkpoint_format(model_dir: Path, config: dict) -> CheckpointFormat | None:
    """The quantization a checkpoint directory declares, or None for a plain one (MXFP4 experts included: they arrive
    as `Mxfp4Weight`s, `stacked_experts`); unsupported ones raise."""
    raw = config.get("quantization_config")
    legacy = model_dir / "quantize_config.json"
    if raw is None and legacy.is_file():
        raw = {"quant_method": "gptq", **json.loads(legacy.read_text())}
    if raw is None:
        return None
    method = str(raw.get("quant_method", "")).lower()
    if method == "mxfp4":  # gpt-oss's experts, read as `Mxfp4Weight`s by `stacked_experts`; the rest is plain
        return None
    if method not in _READERS:
        raise ModelLoadError(f"{model_dir}: quantization method {method!r} is not supported "
                             f"(supported: {', '.join(_READERS)})")
    return _READERS[method](raw, _Refusal(model_dir, method))
