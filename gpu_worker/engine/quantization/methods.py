"""Which quantization a model is served with: the checkpoint's own, or weights quantized at load time."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.text.errors import ModelLoadError

from .formats import KERNEL_GROUP_SIZES, CheckpointFormat
from .kernels import onednn_int8_matmul
from .weights import QuantizedWeight, fake_quantize_int4, quantize_fp8, quantize_int4, quantize_int8

QUANTIZATION_METHODS = ("int8", "int4", "fp8", "w8a8")
DEFAULT_GROUP_SIZE = 128

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightQuantizer:
    """Round-to-nearest: int8 or fp8 per output channel, or int4 in groups of `group_size` inputs, weight-only;
    w8a8: int8 weights multiplied by activations quantized to int8 per token."""

    method: str  # int8, int4, fp8, w8a8
    group_size: int = DEFAULT_GROUP_SIZE
    table: str | None = None  # the embedding table's method (int8 or int4); None: as `for_table` says

    @property
    def bits(self) -> int:
        return 4 if self.method == "int4" else 8

    def __call__(self, w: torch.Tensor) -> QuantizedWeight:
        if self.method == "fp8":
            return quantize_fp8(w)
        if self.method in ("int8", "w8a8"):
            return quantize_int8(w, int8_activations=self.method == "w8a8")
        group = self.group_for(w.shape[1])
        return quantize_int4(w, group) if group else quantize_int8(w)

    def for_table(self, tied: bool) -> WeightQuantizer:
        """The quantizer of the embedding table: `table` where given (llama.cpp's --token-embedding-type), else
        int8 for a table the LM head shares even under int4, as llama.cpp keeps it at 8 bits: the LM head is the
        layer whose rounding every logit sees."""
        if self.table is not None:
            return WeightQuantizer(self.table, self.group_size)
        return WeightQuantizer("int8") if (tied and self.method == "int4") or self.method == "w8a8" else self

    def fake(self, w: torch.Tensor) -> torch.Tensor:
        """`self(w).dequantize()`, cheaper."""
        group = self.group_for(w.shape[1]) if self.method == "int4" else None
        return fake_quantize_int4(w, group) if group else self(w).dequantize()

    def group_for(self, in_features: int) -> int | None:
        """The largest group size the kernels take, at most the requested one, that divides the input size:
        SmolLM2's 576 inputs, say, are 9 groups of 64. None (int8 for this weight) when none divides it."""
        fits = [g for g in KERNEL_GROUP_SIZES if g <= self.group_size and in_features % g == 0]
        if not fits:
            log.warning("input size %d takes no int4 group size; this weight is quantized to int8", in_features)
        return max(fits, default=None)


def method_of(fmt: CheckpointFormat) -> str:
    return "int8" if getattr(fmt, "bits", 4) == 8 else "int4"


def load_time_quantizer(requested: str | None, checkpoint_format: CheckpointFormat | None,
                        device: torch.device) -> WeightQuantizer | None:
    """The quantizer to apply to a dense checkpoint's weights, None when the weights stay as they are
    (no flag, or a pre-quantized checkpoint whose own method the flag, if any, names)."""
    if requested is None:
        return None
    if requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None; got {requested!r}")
    if checkpoint_format is not None:
        if requested != method_of(checkpoint_format):
            raise ModelLoadError(f"the checkpoint is quantized ({checkpoint_format.name}, "
                                 f"{method_of(checkpoint_format)}); quantization={requested!r} conflicts with it")
        return None
    if requested == "fp8" and not (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)):
        raise ModelLoadError("fp8 weights need a CUDA GPU with FP8 row-wise matmuls (compute capability 9.0: "
                             "H100, H200); elsewhere use int8 or int4")
    if requested == "w8a8" and device.type == "cpu" and not onednn_int8_matmul():
        log.warning("oneDNN's int8 matmul is not exact on this CPU (no VNNI); w8a8 is served as weight-only int8")
    return WeightQuantizer(requested)
