"""What a model is loaded from: a checkpoint gives the model's config, its tokenizer and its weights by HF name.

Two formats: an HF directory (config.json, safetensors, tokenizer.json) and a llama.cpp GGUF file (everything
in one file; `gguf/`). The loader and the engine see only this interface.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from .builtin_models import BUILTIN_MODELS, ensure_builtin
from .errors import ModelLoadError
from .model_config import ModelConfig
from .packaged_models import PACKAGED_MODELS, packaged_model_path
from .quantization.formats import CheckpointFormat, read_checkpoint_format
from .quantization.weights import QuantizedWeight
from .tokenizer import Tokenizer


class Checkpoint(Protocol):
    path: Path
    config: ModelConfig
    quantization: CheckpointFormat | None  # how its linears' weights are stored when they are quantized

    def tokenizer(self) -> Tokenizer: ...

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(HF parameter name, tensor in HF's layout), each weight once, on the CPU; a matrix the file stores in
        one of our quantized forms (GGUF's Q8_0 / Q4_0 / Q4_1) may arrive as that quantized weight."""


class HFCheckpoint:
    def __init__(self, model_dir: Path):
        self.path = model_dir
        self.config = ModelConfig.from_dir(model_dir)
        self.quantization = read_checkpoint_format(model_dir, json.loads((model_dir / "config.json").read_text()))

    def tokenizer(self) -> Tokenizer:
        from transformers import AutoTokenizer

        try:
            return Tokenizer(AutoTokenizer.from_pretrained(str(self.path)))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load the tokenizer in {self.path}: {exc}") from exc

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self._files():
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, f.get_tensor(name)

    def _files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [self.path / s for s in shards]
        single = self.path / "model.safetensors"
        if single.is_file():
            return [single]
        raise ModelLoadError(f"{self.path} has no model.safetensors or model.safetensors.index.json")


def is_model_name(model: str) -> bool:
    """A name we resolve ourselves (a built-in or packaged model), as opposed to a path."""
    return model in BUILTIN_MODELS or model in PACKAGED_MODELS


def resolve_model_path(model: str) -> Path:
    """A built-in or packaged model's checkpoint, or `model` itself: an HF directory, a .gguf file or a
    directory holding one."""
    if model in BUILTIN_MODELS:
        return ensure_builtin(model)
    if model in PACKAGED_MODELS:
        return packaged_model_path(model)
    path = Path(model)
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        raise ModelLoadError(
            f"model {model!r} is neither a known name ({', '.join([*PACKAGED_MODELS, *BUILTIN_MODELS])}) "
            "nor a local HF directory or .gguf file"
        )
    return path


def checkpoint_path(model: str | Path) -> Path:
    """What a model name or path is loaded from: an HF directory or a .gguf file (a directory without a
    config.json serves the one GGUF file it holds)."""
    path = resolve_model_path(str(model))
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) > 1:
            raise ModelLoadError(f"{path} holds several GGUF files ({', '.join(g.name for g in ggufs)}): "
                                 "pass the one to serve")
        path = ggufs[0] if ggufs else path  # none: HFCheckpoint names what is missing
    return path


def open_checkpoint(model: str | Path) -> Checkpoint:
    """A model name or path -> its checkpoint (reads the config; weights are read when iterated)."""
    path = checkpoint_path(model)
    if path.suffix == ".gguf":
        from .gguf.checkpoint import GgufCheckpoint

        return GgufCheckpoint(path)
    return HFCheckpoint(path)
