"""`tokenfleet bench router`: is routing the bottleneck? A real router process routes chat requests written to the
request stream at a steady rate (as gateways write them), each tokenized with the served model's own tokenizer
and chat template and looked up in the prefix directory; a worker is registered as live, so every request goes
to its inbox. Reports the delay each request spent before its routing decision (enqueued -> decided, read from
the forwarded messages) and the rate forwarded, for each router concurrency asked for, in alternating rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from .report import add_output_argument, output_path, publish
from .serving import percentiles, synthetic_prompts

WORKER = "bench-worker"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="a packaged or built-in model: its tokenizer")
    p.add_argument("--rate", type=float, default=200.0, help="requests/s written to the request stream")
    p.add_argument("--seconds", type=float, default=10.0, help="per round")
    p.add_argument("--input-len", type=int, default=64, help="prompt length in words")
    p.add_argument("--concurrency", default="1,64", help="router max concurrency values to compare")
    p.add_argument("--rounds", type=int, default=2)
    add_output_argument(p, "router")


def _register(redis, model: str) -> None:
    from gpu_worker.engine.checkpoint import resolve_model_path
    from services.base import protocol as p

    path = resolve_model_path(model)
    info = p.ModelInfo(name=model, model_dir=str(path), max_model_len=8192, tier="small,large")
    redis.hset(p.MODELS_KEY, model, info.model_dump_json())
    redis.zadd(p.workers_key(model), {WORKER: time.time() + 3600})
    status = p.WorkerStatus(worker_id=WORKER, model=model, running=0, waiting=0, inflight=0, backlog=0,
                            kv_blocks_used=0, kv_blocks_total=1, draining=False, updated_at=time.time())
    redis.set(p.heartbeat_key(model, WORKER), status.model_dump_json(), ex=3600)


def one_round(redis_url: str, args: argparse.Namespace, concurrency: int) -> dict:
    import redis as sync_redis

    from services.base import protocol as p

    r = sync_redis.Redis.from_url(redis_url, decode_responses=True)
    r.flushdb()
    _register(r, args.model)
    env = {**os.environ, "REDIS_URL": redis_url, "TOKENFLEET_ROUTER_MAX_CONCURRENCY": str(concurrency),
           "TOKENFLEET_ROUTER_SMALL_MODEL": args.model, "TOKENFLEET_ROUTER_LARGE_MODEL": args.model}
    router = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "router"], env=env)
    inbox = p.inbox_stream(args.model, WORKER)
    try:
        warm = p.GenerateRequest(request_id="warm-up", kind="chat", model=args.model, sampling=p.SamplingOptions(),
                                 messages=[{"role": "user", "content": "warm up"}])
        r.xadd(p.REQUESTS_STREAM, warm.encode())
        while not r.exists(inbox):  # the router is up and its tokenizer loaded
            time.sleep(0.1)
        total = int(args.rate * args.seconds)
        prompts = synthetic_prompts(total, args.input_len, seed=concurrency)
        start = time.monotonic()
        for i, prompt in enumerate(prompts):
            time.sleep(max(0.0, start + i / args.rate - time.monotonic()))
            request = p.GenerateRequest(request_id=f"r{i}", kind="chat", model=args.model,
                                        sampling=p.SamplingOptions(max_tokens=16),
                                        messages=[{"role": "user", "content": prompt}])
            r.xadd(p.REQUESTS_STREAM, request.encode())
        deadline = time.monotonic() + 120
        while r.xlen(inbox) < total + 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        elapsed = time.monotonic() - start
        forwarded = [p.decode(p.GenerateRequest, f) for _, f in r.xrange(inbox)][1:]
    finally:
        router.terminate()
        router.wait(30)
    delays = [(m.routing.decided_at - m.enqueued_at) * 1000 for m in forwarded]
    return {"concurrency": concurrency, "sent": total, "forwarded": len(forwarded),
            "forwarded_per_s": len(forwarded) / elapsed, "delay_ms": percentiles(delays, (50, 99))}


def run(args: argparse.Namespace) -> dict:
    from services.base.redis_client import EmbeddedRedis

    redis_url, embedded = os.environ.get("REDIS_URL"), None
    if not redis_url:
        embedded = EmbeddedRedis()
        redis_url = embedded.url
    levels = [int(c) for c in args.concurrency.split(",")]
    try:
        rounds = [one_round(redis_url, args, c) for _ in range(args.rounds) for c in levels]
    finally:
        if embedded is not None:
            embedded.close()
    summary = {}
    for c in levels:
        mine = [x for x in rounds if x["concurrency"] == c]
        summary[c] = {"forwarded_per_s": statistics.median(x["forwarded_per_s"] for x in mine),
                      "delay_p50_ms": statistics.median(x["delay_ms"]["p50"] for x in mine),
                      "delay_p99_ms": statistics.median(x["delay_ms"]["p99"] for x in mine),
                      "forwarded": [x["forwarded"] for x in mine], "sent": mine[0]["sent"]}
    return {"config": vars(args), "rounds": rounds, "summary": summary}


def format_table(result: dict) -> str:
    lines = [f"{'concurrency':>11} {'sent':>6} {'forwarded/s':>12} {'delay p50 ms':>13} {'delay p99 ms':>13}"]
    for c, s in result["summary"].items():
        lines.append(f"{c:>11} {s['sent']:>6} {s['forwarded_per_s']:>12.1f} {s['delay_p50_ms']:>13.1f} "
                     f"{s['delay_p99_ms']:>13.1f}")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    return publish(result, format_table(result), output_path(args))
