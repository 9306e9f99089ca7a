"""`tokenfleet bench semantic-cache`: how often the semantic cache answers a paraphrase, and how often it
answers a different question, on the shipped pairs (`cache/data/semantic_pairs.jsonl`).

Every `cached` text is stored in one scope of a real Redis (REDIS_URL, else an embedded server), so each
query competes with all of them, then every `query` is looked up. A hit counts as right only when the set
labels (query, the entry it returned) as the same question; any other hit is wrong. Reported at the chosen
threshold with the guard, with the embedding threshold alone, at 0.8 (GPTCache's default, at which it
reports about 9 % wrong hits), and over a sweep of thresholds; lookup latency is split into embedding the
query and searching the index plus reading Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from collections import defaultdict
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import date
from importlib import resources

import numpy as np

from .report import add_output_argument, output_path, publish

SWEEP = [round(0.75 + 0.01 * i, 2) for i in range(21)]  # 0.75 .. 0.95
GPTCACHE_THRESHOLD = 0.8


@dataclass(frozen=True)
class Pair:
    cached: str
    query: str
    same: bool
    kind: str


def load_pairs() -> list[Pair]:
    text = resources.files("cache").joinpath("data/semantic_pairs.jsonl").read_text(encoding="utf-8")
    return [Pair(**json.loads(line)) for line in text.splitlines() if line.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threshold", type=float, default=None,
                   help="default: TOKENFLEET_CACHE_SEMANTIC_THRESHOLD, else the built-in default")
    p.add_argument("--redis-url", default=None, help="default: REDIS_URL, else an embedded Redis")
    p.add_argument("--rounds", type=int, default=5, help="passes over the queries for the latency figures")
    add_output_argument(p, "semantic-cache")


def _no_guard(query: str, cached: str) -> None:
    return None


def _percentiles(seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1000
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


class Evaluation:
    """One scope of a real Redis holding every cached text of the set, looked up under several settings."""

    def __init__(self, redis, pairs: list[Pair], embedder):
        self.redis, self.pairs, self.embedder = redis, pairs, embedder
        self.tenant, self.model = f"bench-{uuid.uuid4().hex[:12]}", "bench"  # no two runs share entries
        self.labels = {(p.query, p.cached): p.same for p in pairs}
        self.vectors: dict[str, np.ndarray] = {}

    def cache(self, threshold: float, guarded: bool = True):
        from cache.semantic_cache import SemanticCache
        from services.base.settings import CacheSettings

        settings = CacheSettings(semantic_threshold=threshold)
        return SemanticCache(self.redis, settings, self.embedder, **({} if guarded else {"guard": _no_guard}))

    async def fill(self) -> int:
        from services.base.protocol import CachedChoice, CachedCompletion, Usage

        texts = sorted({p.cached for p in self.pairs} | {p.query for p in self.pairs})
        self.vectors = dict(zip(texts, self.embedder.embed(texts), strict=True))
        cache, cached = self.cache(1.0), sorted({p.cached for p in self.pairs})
        for text in cached:
            dummy = CachedCompletion(model=self.model, choices=[CachedChoice(text="(bench)", token_ids=[0],
                                                                            finish_reason="stop")],
                                     usage=Usage(prompt_tokens=1, completion_tokens=1))
            await cache.store(self.tenant, self.model, text, self.vectors[text], dummy)
        return len(cached)

    async def score(self, threshold: float, guarded: bool = True) -> dict:
        """Hit rate on same=true pairs, wrong-hit rate on same=false pairs (overall and per kind)."""
        cache = self.cache(threshold, guarded)
        hits, wrong, wrong_hits = defaultdict(int), defaultdict(int), []
        for pair in self.pairs:
            hit = await cache.lookup(self.tenant, self.model, pair.query, self.vectors[pair.query])
            if hit is None:
                continue
            if self.labels.get((pair.query, hit.cached_text)):
                hits[pair.kind] += 1
            else:  # a different question, or one the set does not label: wrong either way
                wrong[pair.kind] += 1
                wrong_hits.append({"query": pair.query, "cached": hit.cached_text,
                                   "similarity": round(hit.similarity, 4)})
        return self._rates(threshold, guarded, hits, wrong, wrong_hits)

    def _rates(self, threshold, guarded, hits, wrong, wrong_hits) -> dict:
        kinds = defaultdict(int)
        for pair in self.pairs:
            kinds[pair.kind] += 1
        same = [p for p in self.pairs if p.same]
        different_kinds = sorted({p.kind for p in self.pairs if not p.same})
        return {"threshold": threshold, "guard": guarded,
                "hit_rate": sum(hits.values()) / len(same),
                "wrong_hit_rate": sum(wrong[k] for k in different_kinds) / (len(self.pairs) - len(same)),
                "wrong_hits_on_paraphrases": wrong["paraphrase"],
                "wrong_hit_rate_by_kind": {k: wrong[k] / kinds[k] for k in different_kinds},
                "wrong_hits": wrong_hits}

    async def latency(self, threshold: float, rounds: int) -> dict:
        """Per query: embedding it (in a thread, as the router does), then the lookup itself."""
        cache = self.cache(threshold)
        embed, lookup = [], []
        for _ in range(rounds):
            for pair in self.pairs:
                started = time.perf_counter()
                vector = await cache.vector(pair.query)
                embedded = time.perf_counter()
                await cache.lookup(self.tenant, self.model, pair.query, vector)
                embed.append(embedded - started)
                lookup.append(time.perf_counter() - embedded)
        return {"embed_ms": _percentiles(embed), "lookup_ms": _percentiles(lookup), "samples": len(lookup)}


async def _run(threshold: float, redis_url: str, rounds: int) -> dict:
    from cache.embedder import shared_embedder
    from cache.semantic_cache import SemanticCache
    from services.base.redis_client import connect

    pairs = load_pairs()
    async with AsyncExitStack() as stack:
        redis = connect(redis_url)
        stack.push_async_callback(redis.aclose)
        evaluation = Evaluation(redis, pairs, shared_embedder())
        stack.push_async_callback(SemanticCache(redis).clear, evaluation.tenant, evaluation.model)
        entries = await evaluation.fill()
        result = {"date": date.today().isoformat(), "pairs": len(pairs), "same": sum(p.same for p in pairs),
                  "different": sum(not p.same for p in pairs), "entries": entries,
                  "guarded": await evaluation.score(threshold),
                  "unguarded": await evaluation.score(threshold, guarded=False),
                  "at_0.8": await evaluation.score(GPTCACHE_THRESHOLD),
                  "at_0.8_unguarded": await evaluation.score(GPTCACHE_THRESHOLD, guarded=False),
                  "sweep": [], "latency": await evaluation.latency(threshold, rounds)}
        for t in SWEEP:
            on, off = await evaluation.score(t), await evaluation.score(t, guarded=False)
            result["sweep"].append({"threshold": t, "hit_rate": on["hit_rate"], "wrong_hit_rate": on["wrong_hit_rate"],
                                    "hit_rate_no_guard": off["hit_rate"],
                                    "wrong_hit_rate_no_guard": off["wrong_hit_rate"]})
    return result


def run(threshold: float | None, redis_url: str | None, rounds: int = 5) -> dict:
    from services.base.redis_client import EmbeddedRedis
    from services.base.settings import CacheSettings

    threshold = CacheSettings().semantic_threshold if threshold is None else threshold
    redis_url = redis_url or os.environ.get("REDIS_URL")
    embedded = None if redis_url else EmbeddedRedis()
    try:
        result = asyncio.run(_run(threshold, redis_url or embedded.url, rounds))
    finally:
        if embedded is not None:
            embedded.close()
    result["threshold"], result["redis"] = threshold, "embedded" if embedded else "REDIS_URL"
    return result


def _row(name: str, r: dict) -> str:
    kinds = " ".join(f"{k} {v:.0%}" for k, v in r["wrong_hit_rate_by_kind"].items())
    return f"| {name} | {r['threshold']:.2f} | {r['hit_rate']:.1%} | {r['wrong_hit_rate']:.1%} | {kinds} |"


def format_table(r: dict) -> str:
    lat = r["latency"]
    lines = [f"tokenfleet bench semantic-cache — {r['pairs']} pairs ({r['same']} same, {r['different']} different), "
             f"{r['entries']} entries in one scope, Redis {r['redis']}, {r['date']}", "",
             "| setting | threshold | hit rate (same) | wrong hits (different) | wrong hits by kind |",
             "|---|---:|---:|---:|---|",
             _row("guard + threshold", r["guarded"]), _row("threshold alone", r["unguarded"]),
             _row("guard + threshold", r["at_0.8"]), _row("threshold alone", r["at_0.8_unguarded"]), "",
             "| threshold | hit rate | wrong hits | hit rate, no guard | wrong hits, no guard |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {s['threshold']:.2f} | {s['hit_rate']:.1%} | {s['wrong_hit_rate']:.1%} | "
              f"{s['hit_rate_no_guard']:.1%} | {s['wrong_hit_rate_no_guard']:.1%} |" for s in r["sweep"]]
    lines += ["", f"latency per query ({lat['samples']} lookups): embedding p50 {lat['embed_ms']['p50']:.2f} ms, "
              f"p99 {lat['embed_ms']['p99']:.2f} ms; index + Redis p50 {lat['lookup_ms']['p50']:.2f} ms, "
              f"p99 {lat['lookup_ms']['p99']:.2f} ms"]
    for hit in r["guarded"]["wrong_hits"]:
        lines.append(f"wrong hit at {r['threshold']:.2f}: {hit['query']!r} answered by {hit['cached']!r} "
                     f"({hit['similarity']:.3f})")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args.threshold, args.redis_url, args.rounds)
    return publish(result, format_table(result), output_path(args))
