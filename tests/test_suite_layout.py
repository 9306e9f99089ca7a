"""The suite mirrors the source: a folder of tests per room of the code, and no two test files of one name (a
reader who finds `test_x.py` in one room knows there is no other `test_x.py` to read)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).parent
ROOT = TESTS.parent
# Folders that test what no single room holds: faults across the whole stack.
ACROSS_ROOMS = {"faults"}


def _rooms() -> set[str]:
    """Top-level packages and the rooms of services/, by their folder names."""
    tops = {p.parent.name for p in ROOT.glob("*/__init__.py")} | {"infra"}
    return tops | {p.parent.name for p in (ROOT / "services").glob("*/__init__.py")}


def test_no_two_test_files_share_a_name():
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []


def test_every_test_folder_is_named_for_a_room_of_the_code():
    folders = {path.name for path in TESTS.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert folders - _rooms() - ACROSS_ROOMS == set()
