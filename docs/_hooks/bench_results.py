"""MkDocs hook: bench/RESULTS.md stays where the benchmarks write it, and the site shows it at bench/RESULTS.md,
with the files it links to (its images), as if they were under docs/."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
RESULTS = "bench/RESULTS.md"
LINK = re.compile(r"\]\(([^)\s#:]+)[^)]*\)")  # relative links and images: no scheme, no bare anchor


def on_files(files, config):
    paths = [RESULTS]
    for target in LINK.findall((ROOT / RESULTS).read_text()):
        linked = (ROOT / "bench" / target).resolve()
        if linked.is_file() and ROOT in linked.parents:
            paths.append(linked.relative_to(ROOT).as_posix())
    for path in dict.fromkeys(paths):
        files.append(File(path, src_dir=str(ROOT), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files
