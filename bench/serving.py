"""`tokenfleet bench serving`: a load generator against an OpenAI-compatible gateway.

Synthetic prompts arrive as a Poisson process; each is a streaming request whose timing is measured on the client
(TTFT, ITL, TPOT, e2e, as `vllm bench serve` defines them). Goodput counts completed requests meeting every SLO per
second. When the gateway adds its `tokenfleet` timing field to the last chunk, stack overhead = client e2e - engine_s.
Any OpenAI-compatible server can be driven (`vllm serve` as the peer); the picture beside the JSON (bench/plots.py)
draws one run, and `python -m bench.plots` draws several (ours and a peer's, or several request rates) in one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .report import add_output_argument, output_path, publish

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word "
    "but not what all were we when your can said there use an each which she do how their if will up other about "
    "out many then them these so some her would make like him into time has look two more write go see number no "
    "way could people my than first water been call who oil its now find long down day did get come made may part"
)
VOCABULARY = tuple(_WORDS.split())  # common English words, about one token each


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0  # from usage; the prompt's word count when the server sends no usage
    output_tokens: int = 0  # from usage; the number of content chunks when the server sends no usage
    ttft_s: float | None = None  # request sent -> first chunk with non-empty content
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    e2e_s: float = 0.0
    server: dict | None = None  # the gateway's `tokenfleet` timing field, if any
    response_id: str | None = None  # the chunks' `id` (ours: chatcmpl-<request id>)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default=os.environ.get("TOKENFLEET_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--model", default="auto", help="a served model, or auto (the router's choice)")
    p.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--input-len", type=int, default=64, help="prompt length in words (about one token each)")
    p.add_argument("--prompt-file", default=None, help="prompts from a JSON file instead of random words: a list, "
                   "or named lists with PATH:NAME picking one (e.g. bench/data/spec_prompts.json:quote), in turn")
    p.add_argument("--output-len", type=int, default=16, help="max_tokens of each request (temperature 0)")
    p.add_argument("--slo", type=_slo_arg, default={},
                   help="goodput SLOs in ms, e.g. ttft_ms=200,tpot_ms=50,e2e_ms=2000")
    p.add_argument("--warmup", type=int, default=16, help="untimed requests sent first, all at once")
    p.add_argument("--seed", type=int, default=0)
    add_output_argument(p, "serving")


def parse_slo(spec: str | None) -> dict[str, float]:
    """'ttft_ms=200,e2e_ms=2000' -> {'ttft_ms': 200.0, 'e2e_ms': 2000.0}; any subset of SLO_KEYS."""
    slos: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if key not in SLO_KEYS:
            raise ValueError(f"unknown SLO key {key!r} in {spec!r}; expected one of {', '.join(SLO_KEYS)}")
        try:
            slos[key] = float(value)
        except ValueError:
            slos[key] = math.nan
        if not sep or not slos[key] > 0:
            raise ValueError(f"SLO {key} needs a positive number of milliseconds, got {item!r}")
    return slos


def _slo_arg(spec: str) -> dict[str, float]:
    try:
        return parse_slo(spec)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send offsets in seconds from the start: the first at 0, then exponential gaps with mean 1/rate."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def synthetic_prompts(n: int, length: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(VOCABULARY, k=length)) for _ in range(n)]


def file_prompts(spec: str, n: int, skip: int = 0) -> list[str]:
    """`n` prompts from `PATH` (a JSON list) or `PATH:NAME` (one list of a JSON object), taken in turn from the
    `skip`-th on and starting over at the end."""
    path, _, name = spec.partition(":")
    prompts = json.loads(Path(path).read_text())
    prompts = prompts[name] if name else prompts
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise SystemExit(f"--prompt-file {spec}: not a non-empty list of prompts")
    return [prompts[(skip + i) % len(prompts)] for i in range(n)]


def _prompts(args: argparse.Namespace, n: int, warmup: bool = False) -> list[str]:
    if args.prompt_file:
        return file_prompts(args.prompt_file, n, skip=args.num_prompts if warmup else 0)
    return synthetic_prompts(n, args.input_len, args.seed + warmup)


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """{'mean', 'p50', ...} of the values (None for each when there are none)."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in ps}}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in ps}}


def tpot_s(r: RequestResult) -> float | None:
    """(e2e - ttft) / (output_tokens - 1); None below two tokens (goodput then takes it as 0, as vLLM does)."""
    if r.output_tokens < 2 or r.ttft_s is None:
        return None
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    ttft = r.ttft_s if r.ttft_s is not None else math.inf  # no content at all cannot meet a TTFT objective
    measured = {"ttft_ms": ttft * 1e3, "tpot_ms": (tpot_s(r) or 0.0) * 1e3, "e2e_ms": r.e2e_s * 1e3}
    return r.ok and all(measured[key] <= limit for key, limit in slos.items())


def summarize(results: list[RequestResult], duration_s: float, slos: dict[str, float] | None = None) -> dict:
    done = [r for r in results if r.ok]
    ms = lambda xs: [x * 1e3 for x in xs if x is not None]
    overheads = [r.e2e_s - r.server["engine_s"] for r in done if r.server and "engine_s" in r.server]
    output_tokens = sum(r.output_tokens for r in done)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else 0.0,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": output_tokens,
        "slos": dict(slos or {}),
        "goodput": (sum(meets_slos(r, slos) for r in done) / duration_s if duration_s > 0 else 0.0) if slos else None,
        "ttft_ms": percentiles(ms(r.ttft_s for r in done)),
        "tpot_ms": percentiles(ms(tpot_s(r) for r in done)),
        "itl_ms": percentiles(ms(gap for r in done for gap in r.itl_s)),
        "e2e_ms": percentiles(ms(r.e2e_s for r in done)),
        "overhead_ms": percentiles(ms(overheads), ps=(50, 99)),
        "route_ms": percentiles(ms(r.server.get("route_s") for r in done if r.server), ps=(50, 99)),
        "tokenfleet_field_share": sum(r.server is not None for r in done) / len(done) if done else 0.0,
        "errors": errors,
    }


def format_table(s: dict) -> str:
    fmt = lambda v, spec=".2f": "-" if v is None else format(v, spec)
    config = s.get("config", {})
    scalars = [
        ("model", f"{config.get('model')} ({config.get('endpoint')}, {config.get('base_url')})"),
        ("completed / failed", f"{s['completed']} / {s['failed']}"),
        ("duration (s)", fmt(s["duration_s"])),
        ("request throughput (req/s)", fmt(s["request_throughput"])),
        ("output throughput (tok/s)", fmt(s["output_throughput"])),
        ("total input tokens", str(s["total_input_tokens"])),
        ("total output tokens", str(s["total_output_tokens"])),
        ("goodput (req/s)" + "".join(f", {k}<={v:g}" for k, v in s["slos"].items()), fmt(s["goodput"])),
        ("stack overhead p50 / p99 (ms)", f"{fmt(s['overhead_ms']['p50'])} / {fmt(s['overhead_ms']['p99'])}"),
        ("router: enqueued to routed p50 / p99 (ms)", f"{fmt(s['route_ms']['p50'])} / {fmt(s['route_ms']['p99'])}"),
        ("requests with tokenfleet timing", fmt(s["tokenfleet_field_share"], ".0%")),
    ]
    lines = ["| metric | value |", "|---|---:|", *(f"| {k} | {v} |" for k, v in scalars), ""]
    lines += ["| latency (ms) | mean | p50 | p90 | p99 |", "|---|---:|---:|---:|---:|"]
    for key in LATENCIES:
        st = s[key]
        lines.append(f"| {key[:-3].upper()} | {' | '.join(fmt(st[p]) for p in ('mean', 'p50', 'p90', 'p99'))} |")
    lines += [f"error x{n}: {msg}" for msg, n in s["errors"].items()]
    return "\n".join(lines)


def request_body(endpoint: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(chunk: dict) -> str:
    choice = (chunk.get("choices") or [{}])[0]
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


def _read_chunk(r: RequestResult, chunk: dict, now: float, last: float | None) -> float | None:
    """Fold one SSE chunk into r; returns the time of the latest content chunk."""
    if chunk.get("error"):
        err = chunk["error"]
        r.error = str(err.get("message", err) if isinstance(err, dict) else err)
    if chunk.get("usage"):
        r.prompt_tokens = chunk["usage"].get("prompt_tokens", r.prompt_tokens)
        r.output_tokens = chunk["usage"].get("completion_tokens", r.output_tokens)
    if "tokenfleet" in chunk:
        r.server = chunk["tokenfleet"]
    r.response_id = r.response_id or chunk.get("id")
    if not _chunk_text(chunk):
        return last
    if last is None:
        r.ttft_s = now
    else:
        r.itl_s.append(now - last)
    return now


async def send_one(client, url: str, body: dict, api_key: str | None = None) -> RequestResult:
    """POST one streaming request and time it; errors end up in the result, never raised."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r, last, start = RequestResult(), None, time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                last = _read_chunk(r, json.loads(data), time.perf_counter() - start, last)
            else:
                r.error = r.error or "stream ended before data: [DONE]"
    except (httpx.HTTPError, OSError, ValueError) as err:
        r.error = f"{type(err).__name__}: {err}"
    r.e2e_s = time.perf_counter() - start
    prompt = body.get("prompt") or body.get("messages", [{}])[-1].get("content", "")
    r.prompt_tokens = r.prompt_tokens or len(prompt.split())
    r.output_tokens = r.output_tokens or len(r.itl_s) + (r.ttft_s is not None)
    r.ok = r.error is None
    return r


def api_base(base_url: str) -> str:
    """The OpenAI base URL, given with its `/v1` (as the openai client takes it) or without (the server's)."""
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


async def run(args: argparse.Namespace) -> dict:
    import httpx

    slos = parse_slo(args.slo) if isinstance(args.slo, str) else dict(args.slo or {})
    prompts = _prompts(args, args.num_prompts)
    arrivals = poisson_arrivals(args.num_prompts, args.request_rate, args.seed)
    url = api_base(args.base_url) + ("/chat/completions" if args.endpoint == "chat" else "/completions")
    gate = asyncio.Semaphore(args.max_concurrency or len(prompts) or 1)
    limits = httpx.Limits(max_connections=args.max_concurrency or len(prompts) or 1, max_keepalive_connections=None)

    async def one(client, prompt: str) -> RequestResult:
        async with gate:
            return await send_one(client, url, request_body(args.endpoint, args.model, prompt, args.output_len),
                                  args.api_key)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client:
        # Warm-up, as vLLM's bench serve does: first requests pay one-time costs (connections, caches).
        warmup = [one(client, prompt) for prompt in _prompts(args, args.warmup, warmup=True)]
        await asyncio.gather(*warmup)
        start, tasks = time.perf_counter(), []
        for prompt, at in zip(prompts, arrivals, strict=True):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(client, prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(results, duration, slos)
    summary["config"] = {k: getattr(args, k, None) for k in (
        "base_url", "model", "endpoint", "num_prompts", "request_rate", "max_concurrency", "input_len",
        "prompt_file", "output_len", "seed")}
    if math.isinf(args.request_rate):
        summary["config"]["request_rate"] = "inf"  # keep the JSON strict
    return summary


def run_from_args(args: argparse.Namespace) -> int:
    """Non-zero when no request completed: a wrong URL, key or model must not pass for a result, nor replace the
    last one."""
    summary = asyncio.run(run(args))
    if not summary["completed"]:
        print(format_table(summary))
        return 1
    return publish(summary, format_table(summary), output_path(args), picture=True)
