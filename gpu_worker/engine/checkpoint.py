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

from services.text import model_paths
from services.text.builtin_models import BUILTIN_MODELS
from services.text.errors import ModelLoadError
from services.text.model_paths import checkpoint_path
from services.text.tokenizer import Tokenizer
from services.text.tokenizer_files import hf_tokenizer

from .builtin_models import ensure_builtin
from .model_config import ModelConfig
from .quantization.formats import CheckpointFormat, read_checkpoint_format
from .quantization.weights import QuantizedWeight


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
        return hf_tokenizer(self.path)

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


def resolve_model_path(model: str) -> Path:
    """As the text layer resolves it (`services.text.model_paths`), a built-in model's checkpoint written
    first: its weights need torch."""
    return ensure_builtin(model) if model in BUILTIN_MODELS else model_paths.resolve_model_path(model)


def open_checkpoint(model: str | Path) -> Checkpoint:
    """A model name or path -> its checkpoint (reads the config; weights are read when iterated)."""
    path = checkpoint_path(resolve_model_path(str(model)))
    if path.suffix == ".gguf":
        from .gguf.checkpoint import GgufCheckpoint

        return GgufCheckpoint(path)
    return HFCheckpoint(path)
