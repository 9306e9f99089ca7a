"""docs/configuration.md, generated from the pydantic-settings classes in services/base/settings.py.

Every `BaseSettings` subclass there becomes a section: its docstring, its environment-variable prefix, and a table
of its fields (variable, type, default, description). A field's description is its `Field(description=...)`, else
the comment on its line, else the comment block right above it. `python -m services.base.settings_page` writes the
page; tests/base/test_settings_page.py fails while the page differs from `render()`.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import re
import sys
import tokenize
import types
import typing
from pathlib import Path

from pydantic import AliasChoices
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from services.base import settings as settings_module

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
COMMAND = "python -m services.base.settings_page"

# The few variables read outside the settings classes (os.environ), so that this page lists every one.
OTHER_VARIABLES = [
    ("TOKENFLEET_CACHE_DIR", "`~/.cache/tokenfleet`",
     "Where the local stack keeps its files: built-in models, compiled CPU kernels, the embedded Redis "
     "(`redis/`), the SQLite ledger, the dev API key (`dev-key`), logs (`logs/`) and benchmark peers' environments."),
    ("OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "unset",
     "Send traces over OTLP/HTTP (the standard OpenTelemetry variables apply). Unset, with no trace file: "
     "tracing is off."),
    ("TOKENFLEET_TRACE_FILE", "unset", "Append every span to this file as a JSON line."),
    ("OTEL_SERVICE_NAME", "`tokenfleet-<service>`", "The traces' service name."),
    ("OTEL_SDK_DISABLED", "unset", "`true` turns tracing off."),
]

INTRO = f"""\
# Configuration

<!-- Generated from services/base/settings.py by `{COMMAND}`: edit the settings' descriptions there, not this
page. -->

Every service reads its settings from environment variables (pydantic-settings), one group per service below.
Names are case-insensitive; booleans are `true` / `false`; where a `tokenfleet` command has a flag for a setting
(`--model`, `--port`, ...), the flag wins. `tokenfleet up` passes its own environment to every service it starts.
Docker compose's own variables (GPUs, host ports, image names) are on the [deployment](deployment.md) page.
"""


def settings_classes() -> list[type[BaseSettings]]:
    """Every `BaseSettings` subclass defined in services/base/settings.py, in source order."""
    found = [obj for obj in vars(settings_module).values()
             if inspect.isclass(obj) and issubclass(obj, BaseSettings) and obj is not BaseSettings
             and obj.__module__ == settings_module.__name__]
    return sorted(found, key=lambda cls: inspect.getsourcelines(cls)[1])


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """Line number -> (comment text, whether the line holds nothing but the comment)."""
    comments: dict[int, tuple[str, bool]] = {}
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            alone = not lines[row - 1][:col].strip()
            comments[row] = (token.string.lstrip("#").strip(), alone)
    return comments


def source_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment in the source: the one on its line, else the block of comment lines right above."""
    source = inspect.getsource(sys.modules[cls.__module__])
    comments = _comments(source)
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    found = {}
    for statement in node.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        trailing = [comments[row][0] for row in range(statement.lineno, statement.end_lineno + 1)
                    if row in comments and not comments[row][1]]
        above, row = [], statement.lineno - 1
        while row in comments and comments[row][1]:
            above.insert(0, comments[row][0])
            row -= 1
        text = " ".join(trailing) or " ".join(above)
        if text:
            found[statement.target.id] = text
    return found


def env_names(cls: type[BaseSettings], name: str, field: FieldInfo) -> list[str]:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return [choice.upper() for choice in alias.choices if isinstance(choice, str)]
    if isinstance(alias, str):
        return [alias.upper()]
    return [(cls.model_config.get("env_prefix", "") + name).upper()]


def type_text(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " / ".join(f"`{arg}`" for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(arg) for arg in args if arg is not type(None))
    if annotation is dict:
        return "JSON object"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, int | str):
        return f"`{value}`"
    return f"`{json.dumps(value)}`"


def description(field: FieldInfo, comment: str | None) -> str:
    """The field's description, else its comment, as a sentence: a comment's first word capitalized unless it is a
    name (`round_robin`, `.gguf`), and a full stop at the end."""
    text = " ".join((field.description or comment or "").split())
    if not text:
        return text
    if re.fullmatch(r"[a-z]+(-[a-z]+)*", text.split()[0].rstrip(":,;")):
        text = text[0].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def section(cls: type[BaseSettings]) -> str:
    title = cls.__name__.removesuffix("Settings")
    doc = " ".join((cls.__dict__.get("__doc__") or "").split())
    prefix = cls.model_config.get("env_prefix", "")
    out = [f"## {title}", ""]
    if doc:
        out += [doc, ""]
    out += [f"`{cls.__name__}`; variables start with `{prefix}`." if prefix else f"`{cls.__name__}`.", "",
            "| variable | type | default | description |", "|---|---|---|---|"]
    comments = source_comments(cls)
    for name, field in cls.model_fields.items():
        variables = " or ".join(f"`{env}`" for env in env_names(cls, name, field))
        out.append(f"| {variables} | {_cell(type_text(field.annotation))} | {_cell(default_text(field))} | "
                   f"{_cell(description(field, comments.get(name)))} |")
    return "\n".join(out) + "\n"


def undocumented() -> list[str]:
    """`Class.field` for every field with neither a description nor a comment."""
    return [f"{cls.__name__}.{name}" for cls in settings_classes() for name, field in cls.model_fields.items()
            if not description(field, source_comments(cls).get(name))]


def render() -> str:
    parts = [INTRO] + [section(cls) for cls in settings_classes()]
    other = ["## Read outside the settings classes", "", "| variable | default | description |", "|---|---|---|"]
    other += [f"| {' or '.join(f'`{n.strip()}`' for n in names.split(','))} | {default} | {_cell(text)} |"
              for names, default, text in OTHER_VARIABLES]
    parts.append("\n".join(other) + "\n")
    return "\n".join(parts)


def main() -> None:
    PAGE.write_text(render())
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
