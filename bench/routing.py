"""`tokenfleet bench routing`: cache- and load-aware worker choice against round robin, same stack, same
workload, back to back: two workers of one model, a few long system prompts (RAG/agent traffic), short
questions arriving as a Poisson process, each worker's KV cache holding only some of the prompts.

Reported per policy: request and output throughput over the run, client TTFT, the prefix-cache hit rate
(prompt tokens the workers' engines found cached, from the completion events), where requests went, and
the router's decision time (directory lookup + scoring), p50/p99.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import time
from datetime import date

from .report import add_output_argument, output_path, publish
from .serving import VOCABULARY, percentiles, poisson_arrivals, send_one, summarize

POLICIES = ("round_robin", "cache_aware")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tokenfleet-large")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-words", type=int, default=1000, help="system prompt length (about a token each)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=6.0, help="requests/s, Poisson arrivals")
    p.add_argument("--kv-prefixes", type=float, default=4.0,
                   help="each worker's KV cache holds this many system prompts' worth of tokens")
    p.add_argument("--seed", type=int, default=0)
    add_output_argument(p, "routing")


def workload(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(system prompt, question) per request, the prompt drawn uniformly from `num_prefixes`."""
    rng = random.Random(args.seed)
    systems = [f"System {i}: " + " ".join(rng.choices(VOCABULARY, k=args.prefix_words))
               for i in range(args.num_prefixes)]
    return [(rng.choice(systems), " ".join(rng.choices(VOCABULARY, k=12)) + "?") for _ in range(args.num_requests)]


def kv_cache_bytes(model: str, dtype: str, tokens: int) -> int:
    import torch

    from gpu_worker.engine.checkpoint import open_checkpoint
    from gpu_worker.engine.kv_cache_format import DenseKVFormat

    config = open_checkpoint(model).config
    per_token = DenseKVFormat(getattr(torch, dtype)).bytes_per_block(config.num_layers, 1, config.num_kv_heads,
                                                                     config.head_dim)
    return per_token * tokens


async def drive(url: str, api_key: str, requests: list[tuple[str, str]], args: argparse.Namespace) -> dict:
    import httpx

    arrivals = poisson_arrivals(len(requests), args.request_rate, args.seed)
    endpoint = url + "/v1/chat/completions"

    def body(system: str, question: str) -> dict:
        return {"model": args.model, "max_tokens": args.output_len, "temperature": 0.0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}

    limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=30.0), limits=limits) as client:
        await send_one(client, endpoint, body("warm-up", "hello?"), api_key)
        start, tasks = time.perf_counter(), []
        for (system, question), at in zip(requests, arrivals, strict=True):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(send_one(client, endpoint, body(system, question), api_key)))
        results = await asyncio.gather(*tasks)
        return summarize(results, time.perf_counter() - start)


def fleet_figures(redis_url: str, model: str) -> dict:
    """From the completion events: prefix-cache hit rate, where requests went, the router's decision time."""
    import redis

    from services.base import protocol as p

    events = p.completion_events(redis.Redis.from_url(redis_url, decode_responses=True).xrange(p.EVENTS_STREAM))
    events = [e for e in events if e.model == model and e.usage.prompt_tokens > 100]  # not the warm-up
    served: dict[str, int] = {}
    for e in events:
        served[e.worker_id] = served.get(e.worker_id, 0) + 1
    decisions = [e.routing.decision_ms for e in events if e.routing and e.routing.decision_ms is not None]
    return {"hit_rate": sum(e.usage.cached_tokens for e in events) / max(1, sum(e.usage.prompt_tokens for e in events)),
            "requests_per_worker": sorted(served.values()), "decision_ms": percentiles(decisions, ps=(50, 99))}


def run_policy(policy: str, args: argparse.Namespace, requests: list[tuple[str, str]]) -> dict:
    from services.launcher.stack import start, wait_ready

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kv_bytes = kv_cache_bytes(args.model, args.dtype, int(args.kv_prefixes * args.prefix_words * 1.1))
    stack = start("127.0.0.1", port, [(args.model, "large"), (args.model, "large")],
                  env={"TOKENFLEET_ROUTER_WORKER_POLICY": policy},
                  worker_env={"TOKENFLEET_WORKER_DTYPE": args.dtype,
                              "TOKENFLEET_WORKER_KV_CACHE_MEMORY_BYTES": str(kv_bytes)})
    try:
        if not wait_ready(stack.url, {args.model}, stack.procs, 600):
            raise RuntimeError("the stack did not become ready")
        while len(_live_workers(stack.redis_url, args.model)) < 2:
            time.sleep(0.5)
        summary = asyncio.run(drive(stack.url, stack.api_key, requests, args))
        return {**summary, **fleet_figures(stack.redis_url, args.model)}
    finally:
        stack.stop()


def _live_workers(redis_url: str, model: str) -> list[str]:
    import redis

    from services.base import protocol as p

    return redis.Redis.from_url(redis_url).zrangebyscore(p.workers_key(model), time.time(), "+inf")


def run(args: argparse.Namespace) -> dict:
    requests = workload(args)
    result = {"date": date.today().isoformat(), "config": {k: v for k, v in vars(args).items()
                                                           if k not in ("func", "json_path", "benchmark")}}
    for policy in POLICIES:
        result[policy] = run_policy(policy, args, requests)
    result["throughput_ratio"] = (result["cache_aware"]["request_throughput"]
                                  / max(1e-9, result["round_robin"]["request_throughput"]))
    return result


def format_table(result: dict) -> str:
    rows = [("request throughput (req/s)", "request_throughput", ".2f"),
            ("output throughput (tok/s)", "output_throughput", ".1f"), ("prefix-cache hit rate", "hit_rate", ".0%")]
    lines = ["| | round robin | cache + load aware |", "|---|---:|---:|"]
    for label, key, spec in rows:
        lines.append(f"| {label} | {format(result['round_robin'][key], spec)} | "
                     f"{format(result['cache_aware'][key], spec)} |")
    for label, key in (("TTFT p50 (ms)", "p50"), ("TTFT p99 (ms)", "p99")):
        lines.append(f"| {label} | {result['round_robin']['ttft_ms'][key]:.0f} | "
                     f"{result['cache_aware']['ttft_ms'][key]:.0f} |")
    for label, key in (("decision p50 (ms)", "p50"), ("decision p99 (ms)", "p99")):
        lines.append(f"| router {label} | {result['round_robin']['decision_ms'][key]:.2f} | "
                     f"{result['cache_aware']['decision_ms'][key]:.2f} |")
    lines.append(f"| requests per worker | {result['round_robin']['requests_per_worker']} | "
                 f"{result['cache_aware']['requests_per_worker']} |")
    lines.append(f"| failed | {result['round_robin']['failed']} | {result['cache_aware']['failed']} |")
    lines.append(f"\nthroughput, cache + load aware / round robin: {result['throughput_ratio']:.2f}x")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), output_path(args))
