"""Reading a GGUF file's metadata fields: the one place that knows how gguf-py's reader hands them out."""

from __future__ import annotations

import gguf

from ..errors import ModelLoadError


def value(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def required(reader: gguf.GGUFReader, key: str):
    found = value(reader, key)
    if found is None:
        raise ModelLoadError(f"GGUF file {reader.data.filename} lacks metadata {key!r}")
    return found
