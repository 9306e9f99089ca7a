"""A model's tokenizer opened from its files, without torch: the one way the gateway, the router and the
engine's checkpoints get a `Tokenizer`, so that every hop tokenizes a prompt alike."""

from __future__ import annotations

from pathlib import Path

import gguf
from transformers import PreTrainedTokenizerFast

from services.text import gguf_tokenizer
from services.text.builtin_models import BUILTIN_MODELS, build_tokenizer, is_built
from services.text.errors import ModelLoadError
from services.text.gguf_metadata import open_reader
from services.text.model_paths import checkpoint_path
from services.text.tokenizer import Tokenizer


def open_tokenizer(model: str | Path) -> Tokenizer:
    """A model name or path (as `model_paths.checkpoint_path` takes it) -> its tokenizer. A built-in model whose
    checkpoint this host has not written gets the tokenizer its checkpoint will hold (trained, seconds)."""
    path = checkpoint_path(model)
    if path.suffix == ".gguf":
        return gguf_file_tokenizer(open_reader(path))
    if str(model) in BUILTIN_MODELS and not is_built(str(model)):
        return Tokenizer(build_tokenizer())
    return hf_tokenizer(path)


def hf_tokenizer(model_dir: Path) -> Tokenizer:
    """The tokenizer of an HF directory: tokenizer.json's own pipeline, with tokenizer_config.json's special
    tokens and the chat template. Not `AutoTokenizer`: transformers 5 reads the model's config through modules
    that import torch, and its model-specific classes rebuild the pipeline rather than run the file's."""
    try:
        return Tokenizer(PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc


def gguf_file_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes."""
    return Tokenizer(gguf_tokenizer.build_tokenizer(reader))
