"""Where a model name or path is read from, found without torch and without writing anything: a built-in model's
cache directory (its weights are written by the engine when it first serves it), a packaged model's file, or
the path itself."""

from __future__ import annotations

from pathlib import Path

from services.text.builtin_models import BUILTIN_MODELS, builtin_path
from services.text.errors import ModelLoadError
from services.text.packaged_models import PACKAGED_MODELS, packaged_model_path


def is_model_name(model: str) -> bool:
    """A name we resolve ourselves (a built-in or packaged model), as opposed to a path."""
    return model in BUILTIN_MODELS or model in PACKAGED_MODELS


def resolve_model_path(model: str) -> Path:
    """A built-in model's checkpoint directory (written or not), a packaged model's file, or `model` itself: an
    HF directory, a .gguf file or a directory holding one."""
    if model in BUILTIN_MODELS:
        return builtin_path(model)
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
        path = ggufs[0] if ggufs else path  # none: opening it names what is missing
    return path
