"""`tokenfleet bench soak`: the whole stack (as `tokenfleet up` runs it) under a steady request rate for minutes.

Reports what a leak or a slow degradation would show: every service's RSS sampled every few seconds and its
slope (MB/min, least squares, after a warm-up; each half separately too), p50/p99 latency per minute, and the
accounting of every request: sent, accepted, completed, errors, lost (accepted, never completed nor failed),
duplicated (more than one ledger row) and ledger rows whose tokens differ from what the client received.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import tempfile
import time
from datetime import date

import numpy as np

from .report import add_output_argument, output_path, publish
from .serving import percentiles, poisson_arrivals, request_body, send_one, synthetic_prompts

SAMPLE_EVERY_S = 5.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--request-rate", type=float, default=2.0, help="requests/s, Poisson arrivals")
    p.add_argument("--input-len", type=int, default=48, help="prompt length in words")
    p.add_argument("--output-len", type=int, default=24, help="max_tokens of each request")
    p.add_argument("--warmup-minutes", type=float, default=1.0, help="left out of the RSS slopes")
    add_output_argument(p, "soak")


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, bytes) samples, in MB per minute."""
    if len(samples) < 3:
        return None
    t, rss = np.array(samples).T
    return float(np.polyfit(t / 60.0, rss / 1e6, 1)[0])


def _rss(pid: int) -> float:
    """The process's RSS with its children's (Celery's pool, a redis-server)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
    except psutil.NoSuchProcess:
        return float("nan")


async def _sample(processes: dict[str, int], samples: dict[str, list[tuple[float, float]]], start: float,
                  stop: asyncio.Event) -> None:
    while not stop.is_set():
        now = time.monotonic() - start
        for name, pid in processes.items():
            samples[name].append((now, _rss(pid)))
        await asyncio.sleep(SAMPLE_EVERY_S)


async def drive(url: str, api_key: str, model: str, args: argparse.Namespace,
                processes: dict[str, int]) -> tuple[list, dict]:
    import httpx

    duration_s = args.minutes * 60
    arrivals = [a for a in poisson_arrivals(int(duration_s * args.request_rate * 2) + 10, args.request_rate)
                if a < duration_s]
    prompts = synthetic_prompts(len(arrivals), args.input_len)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in processes}
    stop, start = asyncio.Event(), time.monotonic()
    sampler = asyncio.create_task(_sample(processes, samples, start, stop))
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client:
        async def one(prompt: str, at: float):
            result = await send_one(client, url + "/v1/chat/completions",
                                    request_body("chat", model, prompt, args.output_len), api_key)
            return at, result

        tasks = []
        for prompt, at in zip(prompts, arrivals, strict=True):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            tasks.append(asyncio.create_task(one(prompt, at)))
        results = await asyncio.gather(*tasks)
    stop.set()
    await sampler
    return results, samples


def ledger_check(database_url: str, results: list) -> dict:
    """Ledger rows of the completed requests: one each, with the tokens the client received."""
    from sqlalchemy import func, select

    from services.accounting import db
    from services.accounting.models import LedgerRow

    completed = {r.response_id.split("-", 1)[1]: r for _, r in results if r.ok and r.response_id}
    engine = db.connect(database_url)
    deadline, rows = time.monotonic() + 60, []
    while time.monotonic() < deadline:
        with engine.connect() as connection:
            rows = connection.execute(select(LedgerRow.request_id, LedgerRow.completion_tokens, func.count())
                                      .where(LedgerRow.request_id.in_(completed))
                                      .group_by(LedgerRow.request_id, LedgerRow.completion_tokens)).all()
        if len(rows) >= len(completed):
            break
        time.sleep(1)
    engine.dispose()
    return {"ledger_rows": sum(n for _, _, n in rows), "duplicated": sum(n - 1 for _, _, n in rows if n > 1),
            "missing_rows": len(completed) - len({rid for rid, _, _ in rows}),
            "token_mismatches": sum(1 for rid, tokens, _ in rows if tokens != completed[rid].output_tokens)}


def _cut(error: str) -> bool:
    """The stream ended without [DONE], or its connection broke (an httpx exception): not an error event."""
    return error.startswith("stream ended") or re.match(r"^\w+(Error|Timeout): ", error) is not None


def summarize(results: list, samples: dict, args: argparse.Namespace) -> dict:
    accepted = [r for _, r in results if r.response_id]  # the stream started: the gateway took it
    per_minute = {}
    for at, r in results:
        if r.ok:
            per_minute.setdefault(int(at // 60), []).append(r.e2e_s * 1000)
    warm = args.warmup_minutes * 60
    memory = {}
    for name, points in samples.items():
        kept = [(t, b) for t, b in points if t >= warm and b == b]
        middle = (kept[0][0] + kept[-1][0]) / 2 if kept else 0
        memory[name] = {"rss_start_mb": points[0][1] / 1e6 if points else None,
                        "rss_end_mb": points[-1][1] / 1e6 if points else None,
                        "slope_mb_per_min": slope_mb_per_min(kept),
                        "slope_first_half": slope_mb_per_min([p for p in kept if p[0] <= middle]),
                        "slope_second_half": slope_mb_per_min([p for p in kept if p[0] >= middle])}
    return {"sent": len(results), "accepted": len(accepted), "completed": sum(r.ok for _, r in results),
            "errors": sum(1 for _, r in results if r.error),
            "lost": sum(1 for r in accepted if not r.ok and _cut(r.error)),
            "refused": sum(1 for _, r in results if not r.response_id),
            "error_samples": sorted({r.error[:120] for _, r in results if r.error})[:5],
            "e2e_ms_by_minute": {m: percentiles(v, (50, 99)) for m, v in sorted(per_minute.items())},
            "memory": memory}


def format_table(s: dict) -> str:
    lines = [f"requests: sent {s['sent']}, accepted {s['accepted']}, completed {s['completed']}, errors "
             f"{s['errors']}, lost {s['lost']}, duplicated {s['duplicated']}, ledger rows {s['ledger_rows']} "
             f"(missing {s['missing_rows']}, token mismatches {s['token_mismatches']})",
             "minute  e2e p50 ms  e2e p99 ms"]
    for minute, p in s["e2e_ms_by_minute"].items():
        lines.append(f"{minute:>6}  {p['p50'] or 0:>10.0f}  {p['p99'] or 0:>10.0f}")
    lines.append(f"{'service':<34} {'RSS start MB':>12} {'RSS end MB':>10} {'MB/min':>8} {'1st half':>8} "
                 f"{'2nd half':>8}")
    for name, m in s["memory"].items():
        cells = [m[k] if m[k] is not None else float("nan") for k in
                 ("rss_start_mb", "rss_end_mb", "slope_mb_per_min", "slope_first_half", "slope_second_half")]
        lines.append(f"{name:<34} {cells[0]:>12.0f} {cells[1]:>10.0f} {cells[2]:>8.2f} {cells[3]:>8.2f} "
                     f"{cells[4]:>8.2f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    import os

    from services.launcher.stack import default_workers, start, wait_ready

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ledger_dir = tempfile.TemporaryDirectory(prefix="tokenfleet-soak-")
    database_url = os.environ.get("DATABASE_URL") or f"sqlite:///{ledger_dir.name}/ledger.db"
    workers = default_workers()
    stack = start("127.0.0.1", port, workers, env={"DATABASE_URL": database_url})
    try:
        if not wait_ready(stack.url, {m for m, _ in workers}, stack.procs, 600):
            raise RuntimeError("the stack did not become ready")
        processes = {s.name: s.proc.pid for s in stack.supervisor.services}
        results, samples = asyncio.run(drive(stack.url, stack.api_key, workers[0][0], args, processes))
        summary = summarize(results, samples, args)
        summary.update(ledger_check(database_url, results))
    finally:
        stack.stop()
        ledger_dir.cleanup()
    summary["config"] = {"date": date.today().isoformat(), **{k: v for k, v in vars(args).items()
                                                              if k in ("minutes", "request_rate", "input_len",
                                                                       "output_len", "warmup_minutes")},
                         "workers": workers}
    return summary


def run_from_args(args: argparse.Namespace) -> int:
    summary = run(args)
    return publish(summary, format_table(summary), output_path(args))
