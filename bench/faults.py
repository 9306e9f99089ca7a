"""`tokenfleet bench faults`: the real `tokenfleet up` (default model, a cache directory of its own) with streams
in flight through two faults, each client's tokens against its ledger row.

"redis-kill": the embedded redis-server SIGKILLed mid-stream (the supervisor restarts it from its append-only
file): recovery, from the kill to a new request answered 200, and the 503s meanwhile. "stack-kill": every process
of the stack SIGKILLed mid-stream, then `tokenfleet up` again on the same directory: each cut stream billed
"cancelled" with what its client got. In both, rows are read until they settle (a row may be amended), then each
checked against its client (status, completion tokens), none missing, none twice."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from datetime import UTC, date, datetime
from pathlib import Path

import httpx
import psutil

from .report import add_output_argument, output_path, publish
from .serving import request_body, synthetic_prompts

UP_TIMEOUT_S = 600  # a first start may write checkpoints; the kernels come built through the symlink
FEW_TOKENS = 5  # each stream is mid-generation, not queued, when the fault comes
SETTLE_S = 60  # the ledger's rows of a phase are read until they match, or this long
RECOVERY_TIMEOUT_S = 180
# Settings that would take state out of the temporary cache directory, or a key other than its dev key.
ELSEWHERE = ("REDIS_URL", "TOKENFLEET_REDIS_URL", "DATABASE_URL", "TOKENFLEET_DATABASE_URL",
             "TOKENFLEET_GATEWAY_DEV_KEY", "TOKENFLEET_GATEWAY_JOURNAL_DIR")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=24, help="streamed completions in flight at each fault")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens each stream asks for (ignore_eos)")
    p.add_argument("--input-len", type=int, default=16, help="prompt length in words (unique prompts)")
    add_output_argument(p, "faults")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stream:
    status: int = 0  # the HTTP status; 0 while none came (or the connection was refused)
    request_id: str | None = None  # from the chunk id, cmpl-<request id>
    tokens: int = 0  # tokens received: one logprobs entry each
    last_chunk_tokens: int = 0  # of those, the last chunk's
    usage_tokens: int | None = None  # what the final usage chunk said
    done: bool = False  # [DONE] came
    error_code: str | None = None  # of an error event, or of the reply that refused the stream
    ended: str = "running"  # then done (whole, [DONE]), error (an error event), cut (no [DONE]) or refused


class Up:
    """`tokenfleet up` in its own session, its console read by a thread, on `cache` and `port`. `env`: settings on
    top of this environment's (less those that would take state elsewhere); `launcher`: what runs the command (a
    test's wrapper that sets a signal disposition first)."""

    def __init__(self, cache: Path, port: int, env: dict[str, str] | None = None, launcher: tuple[str, ...] = ()):
        self.cache, self.port, self.launcher = cache, port, launcher
        # The finance API on a free port, not port + 1 (`up`'s default), which something else may hold.
        self.env = {**{k: v for k, v in os.environ.items() if k not in ELSEWHERE}, "TOKENFLEET_CACHE_DIR": str(cache),
                    "TOKENFLEET_ACCOUNTING_PORT": str(free_port()), **(env or {})}
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.console: list[str] = []
        self.reader: threading.Thread | None = None

    def start(self) -> float:
        """Seconds from the command to its console's "tokenfleet is up"."""
        started = time.monotonic()
        self.proc = subprocess.Popen([*self.launcher, sys.executable, "-m", "services.launcher.cli", "up", "--port",
                                      str(self.port)], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.console = []
        self.reader = threading.Thread(target=lambda: self.console.extend(self.proc.stdout), daemon=True)
        self.reader.start()
        while not self.said("tokenfleet is up"):
            if self.proc.poll() is not None or time.monotonic() > started + UP_TIMEOUT_S:
                raise RuntimeError("`tokenfleet up` did not come up:\n" + "".join(self.console[-30:]))
            time.sleep(0.1)
        # its own key, else the one its first start made
        self.api_key = self.env.get("TOKENFLEET_GATEWAY_DEV_KEY") or (self.cache / "dev-key").read_text().strip()
        return time.monotonic() - started

    def said(self, line: str) -> bool:
        return any(said.rstrip("\n") == line for said in self.console)

    def redis_server(self) -> psutil.Process:
        """Its redis-server, found by the unix socket of the stack's REDIS_URL (the server's process title names
        it as `unixsocket:<path>`)."""
        from services.launcher.stack import STATE_FILE

        path = json.loads((self.cache / STATE_FILE).read_text())["redis_url"].removeprefix("unix://")
        return next(p for p in psutil.Process(self.proc.pid).children(recursive=True)
                    if f"unixsocket:{path}" in " ".join(p.cmdline()))

    def kill(self) -> None:
        """Every process of the stack at once, Redis too, as a crash of its host would."""
        processes = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        for process in processes:
            process.kill()
        psutil.wait_procs(processes, timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:  # hung on its way down: nothing of it may outlive the probe
            self.kill()

    def ledger(self, request_ids: set[str]) -> dict[str, list[tuple[str, int]]]:
        """Request id -> its ledger rows (status, completion tokens): one each, unless a duplicate slipped in."""
        from sqlalchemy import select

        from services.accounting import db
        from services.accounting.models import LedgerRow

        engine = db.connect(f"sqlite:///{self.cache / 'ledger.db'}")
        try:
            with engine.connect() as connection:
                rows = connection.execute(select(LedgerRow.request_id, LedgerRow.status, LedgerRow.completion_tokens)
                                          .where(LedgerRow.request_id.in_(request_ids))).all()
        finally:
            engine.dispose()
        return {rid: [(status, tokens) for other, status, tokens in rows if other == rid] for rid, _, _ in rows}


def stream(url: str, api_key: str, body: dict, result: Stream) -> Stream:
    """One streamed completion read as raw SSE, filling `result` as it goes (a watcher reads it meanwhile)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {api_key}"}) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error_code = str(response.status_code)
            else:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        read_event(result, line.removeprefix("data: "))
    except httpx.TransportError:  # refused before a stream, or cut mid-stream (what came before is kept)
        pass
    result.ended = ("refused" if result.status != 200 else "error" if result.error_code else
                    "done" if result.done else "cut")
    return result


def read_event(result: Stream, data: str) -> None:
    if data == "[DONE]":
        result.done = True
        return
    chunk = json.loads(data)
    if "error" in chunk:
        result.error_code = str(chunk["error"].get("code") or chunk["error"].get("type"))
        return
    result.request_id = chunk["id"].split("-", 1)[1]
    if tokens := sum(len((choice.get("logprobs") or {}).get("tokens") or []) for choice in chunk["choices"]):
        result.tokens += tokens
        result.last_chunk_tokens = tokens
    result.usage_tokens = (chunk.get("usage") or {}).get("completion_tokens", result.usage_tokens)


def streams_in_flight(up: Up, phase: str, args: argparse.Namespace, model: str,
                      seed: int) -> tuple[list[Stream], list[Future]]:
    """`args.streams` unique prompts streaming, returned once each has a few tokens (or has ended)."""
    results, pool = [Stream() for _ in range(args.streams)], ThreadPoolExecutor(args.streams)
    prompts = [f"{phase} {i}: {words}" for i, words in enumerate(synthetic_prompts(args.streams, args.input_len, seed))]
    futures = [pool.submit(stream, up.url, up.api_key, {**request_body("completions", model, prompt, args.max_tokens),
                                                        "ignore_eos": True, "logprobs": 0}, result)
               for prompt, result in zip(prompts, results, strict=True)]
    pool.shutdown(wait=False)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while not all(r.tokens >= FEW_TOKENS or r.ended != "running" for r in results):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{phase}: streams did not start: {results}")
        time.sleep(0.02)
    return results, futures


def recovery(up: Up, killed_at: float) -> dict:
    """Seconds from the kill to the first small chat completion answered 200, and the other answers before it."""
    seen: Counter[str] = Counter()
    while time.monotonic() < killed_at + RECOVERY_TIMEOUT_S:
        try:
            status = str(httpx.post(up.url + "/v1/chat/completions", timeout=30,
                                    headers={"Authorization": f"Bearer {up.api_key}"},
                                    json={"model": "auto", "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "Hi"}]}).status_code)
        except httpx.TransportError as err:
            status = type(err).__name__
        if status == "200":
            return {"recovery_s": time.monotonic() - killed_at, "refused_503": seen["503"], "replies_before": seen}
        seen[status] += 1
        time.sleep(0.2)
    return {"recovery_s": None, "refused_503": seen["503"], "replies_before": seen}


def expected(s: Stream, row: tuple[str, int]) -> bool:
    """A whole stream is billed "ok", one ended by an error anything else, a cut one "cancelled"; each the tokens its
    client got, or, cut by a gateway killed between a chunk's socket write and its journal line, those before its
    last chunk (`gateway/delivery_journal.py`): never more."""
    status, tokens = row
    agrees = {"done": status == "ok", "error": status != "ok", "cut": status == "cancelled"}.get(s.ended, False)
    billable = {s.tokens, s.tokens - s.last_chunk_tokens} if s.ended == "cut" else {s.tokens}
    return agrees and tokens in billable


def check_ledger(up: Up, results: list[Stream], since: float) -> dict:
    """The streams' rows once each is as expected (or SETTLE_S on): rows checked, missing, duplicates, mismatches."""
    by_id = {s.request_id: s for s in results if s.request_id}
    deadline = time.monotonic() + SETTLE_S
    while True:
        rows = up.ledger(set(by_id))
        settled = all(len(rows.get(rid, [])) == 1 and expected(s, rows[rid][0]) for rid, s in by_id.items())
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    mismatches = [{"request_id": rid, "client": s.ended, "error_code": s.error_code, "client_tokens": s.tokens,
                   "usage_tokens": s.usage_tokens, "ledger": rows[rid]}
                  for rid, s in by_id.items() if rid in rows and not all(expected(s, row) for row in rows[rid])]
    return {"settled": settled, "settle_s": time.monotonic() - since, "rows_checked": sum(map(len, rows.values())),
            "missing": sorted(set(by_id) - set(rows)), "duplicates": sorted(r for r in rows if len(rows[r]) > 1),
            "without_request_id": len(results) - len(by_id), "mismatches": mismatches}


def outcomes(results: list[Stream], max_tokens: int) -> dict[str, int]:
    """How the streams ended; "done short": [DONE] after fewer tokens than asked for, or than its usage says."""
    short = lambda s: s.ended == "done" and not s.tokens == s.usage_tokens == max_tokens
    return dict(Counter(s.ended + (" short" if short(s) else f" {s.error_code}" if s.error_code else "")
                        for s in results))


def redis_kill(up: Up, args: argparse.Namespace, model: str) -> dict:
    results, futures = streams_in_flight(up, "redis-kill", args, model, seed=1)
    up.redis_server().kill()
    outage = recovery(up, time.monotonic())
    wait(futures)
    return {**outage, **figures(up, results, args, since=time.monotonic())}


def stack_kill(up: Up, args: argparse.Namespace, model: str) -> dict:
    results, futures = streams_in_flight(up, "stack-kill", args, model, seed=2)
    up.kill()
    wait(futures)
    restarted = time.monotonic()
    restart_to_up_s = up.start()
    checked = figures(up, results, args, since=restarted)
    return {"restart_to_up_s": restart_to_up_s, "restart_to_settled_s": checked["ledger"]["settle_s"], **checked}


def figures(up: Up, results: list[Stream], args: argparse.Namespace, since: float) -> dict:
    return {"ended": outcomes(results, args.max_tokens), "ledger": check_ledger(up, results, since),
            "streams": [asdict(s) for s in results]}


def format_table(r: dict) -> str:
    redis, stack = r["redis_kill"], r["stack_kill"]
    seconds = lambda v: "-" if v is None else f"{v:.1f}"
    both = lambda f: f"{f(redis)} | {f(stack)}"
    rows = [("recovery s (kill to a new request answered 200)", f"{seconds(redis['recovery_s'])} | -"),
            ("503s meanwhile (all answers before the 200)",
             f"{redis['refused_503']} {dict(redis['replies_before'])} | -"),
            ("restart to up s / to rows settled s",
             f"- | {seconds(stack['restart_to_up_s'])} / {seconds(stack['restart_to_settled_s'])}"),
            ("streams ended", both(lambda p: ", ".join(f"{k} {n}" for k, n in p["ended"].items()))),
            ("rows checked", both(lambda p: p["ledger"]["rows_checked"])),
            ("missing / duplicates", both(lambda p: f"{len(p['ledger']['missing'])} / "
                                                     f"{len(p['ledger']['duplicates'])}")),
            ("mismatches (must be 0)", both(lambda p: len(p["ledger"]["mismatches"])))]
    c = r["config"]
    lines = [f"tokenfleet up ({c['model']}), {c['streams']} streams of {c['max_tokens']} tokens at each fault; host: "
             f"{r['host']['cpu']}, CPUs {r['host']['cpus']}; first start {r['up_s']:.1f} s", "",
             "| figure | redis-kill | stack-kill |", "|---|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    problems = [f"{phase} {what}: {each}" for phase in ("redis_kill", "stack_kill")
                for what in ("mismatches", "missing", "duplicates") for each in r[phase]["ledger"][what]]
    return "\n".join(lines + problems)


def run(args: argparse.Namespace) -> dict:
    from services.base.settings import cache_dir
    from services.launcher.stack import default_workers

    from .host import describe

    model = default_workers()[0][0]
    result = {"date": date.today().isoformat(), "started": datetime.now(UTC).isoformat(timespec="seconds"),
              "command": shlex.join(sys.argv), "host": describe(),
              "config": {"model": model, **{k: getattr(args, k) for k in ("streams", "max_tokens", "input_len")}}}
    with tempfile.TemporaryDirectory(prefix="tf-faults-") as cache:
        for shared in ("kernels", "models"):  # built once in the real cache: nothing recompiles
            (cache_dir() / shared).mkdir(parents=True, exist_ok=True)
            (Path(cache) / shared).symlink_to(cache_dir() / shared, target_is_directory=True)
        up = Up(Path(cache), free_port())
        try:
            result["up_s"] = up.start()
            result["redis_kill"] = redis_kill(up, args, model)
            result["stack_kill"] = stack_kill(up, args, model)
        finally:
            up.stop()
    return result


def run_from_args(args: argparse.Namespace) -> int:
    """Non-zero when a row is missing, twice, or bills other than its client got."""
    result = run(args)
    publish(result, format_table(result), output_path(args))
    ledgers = [result[phase]["ledger"] for phase in ("redis_kill", "stack_kill")]
    return 1 if any(lg["mismatches"] or lg["missing"] or lg["duplicates"] for lg in ledgers) else 0
