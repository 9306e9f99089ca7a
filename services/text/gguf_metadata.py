"""Opening a GGUF file and reading its metadata fields: the one place that knows how gguf-py's reader hands
them out."""

from __future__ import annotations

from pathlib import Path

import gguf

from services.text.errors import ModelLoadError


def value(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def required(reader: gguf.GGUFReader, key: str):
    found = value(reader, key)
    if found is None:
        raise ModelLoadError(f"GGUF file {reader.data.filename} lacks metadata {key!r}")
    return found


def open_reader(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
