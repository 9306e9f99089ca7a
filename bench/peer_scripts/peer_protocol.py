"""The line protocol between `bench/external_peers.py` and a peer script, which imports this file from its own
folder: the peer loads its model, says it is ready, then answers one request line at a time until its input
ends, so that a benchmark can interleave it with our engine in rounds without reloading it."""

import json
import sys

MARKER = "TOKENFLEET_PEER"  # peers log to stdout too; the protocol's lines start with this


def say(**fields) -> None:
    print(MARKER, json.dumps(fields), flush=True)


def serve(version: str, handlers: dict) -> None:
    """`handlers` maps a workload name to a function of the request returning its reading (an engine's tokens/s,
    a list for batch 1's repeats; a kernel's seconds); an error is answered, not fatal, so the benchmark can report
    it."""
    say(ready=True, version=version)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            say(reading=handlers[request["workload"]](request))
        except Exception as exc:  # noqa: BLE001 - reported to the benchmark, which carries on without this figure
            say(error=f"{type(exc).__name__}: {exc}")
