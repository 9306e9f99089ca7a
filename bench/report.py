"""What every `tokenfleet bench` command ends with: the table on stdout, the figures as JSON if asked."""

from __future__ import annotations

import json
import statistics


def publish(result: dict, table: str, json_path: str | None) -> int:
    print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


def in_turn(contestants: list, round_index: int) -> list:
    """The contestants' order in a round: each leads in turn, so that no one always runs first (or last) on a
    host whose speed drifts."""
    shift = round_index % len(contestants)
    return contestants[shift:] + contestants[:shift]


def spread(values: list[float]) -> str:
    """A ratio's rounds as the tables give them: median [min, max]."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"
