"""`python -m bench.lab.fuzz [--examples 2000]`: Schemathesis' property-based fuzzing of the gateway's own OpenAPI
document against the gateway, in process (ASGI), on a real Redis (REDIS_URL, else an embedded one): a test of the
code, run long, rather than a benchmark of a deployment. No worker runs: a model is served with none alive, so
the requests that pass validation end 503 `no_worker`. Prints how many cases ran and the failures by check;
tests/gateway/test_schemathesis.py runs the same with few examples.

What is checked: no 5xx but those the document declares for a missing worker (503), every 4xx/5xx an OpenAI
error object, and Schemathesis' conformance checks (status codes, content types, response schemas, headers, and
that schema-valid data is accepted and invalid data rejected) except where noted in `CONFIG`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..report import script_main

MODEL = "fuzz-model"  # served, with no live worker
TENANT = "fuzz"
# Schemathesis' settings for this API (the `schemathesis.toml` keys), beside the Authorization header.
CONFIG = {
    "generation": {"database": "none"},  # no .hypothesis/ folder
    "checks": {
        # The one 5xx a fuzzer can reach here, and the document declares it: no worker of the model is alive.
        "not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "503"]},
    },
    "operations": [
        # An id in the path takes any string, so it has no invalid values to send (Hypothesis would spend seconds
        # looking for one, then fail its filter_too_much health check).
        {"include-path-regex": "[{]", "generation": {"mode": "positive"}},
        # Schema-valid bodies that still name something that does not exist (a batch's input file; an upload's
        # lines, which a schema cannot describe inside a multipart file) are a 400, as the document says.
        {"include-name": ["POST /v1/batches", "POST /v1/files"],
         "checks": {"positive_data_acceptance": {"enabled": False}}},
    ],
}


def openai_error_object(ctx, response, case) -> bool | None:
    """Every 4xx and 5xx (but /readyz's 503, a probe's answer) is OpenAI's error object."""
    if response.status_code < 400 or case.path == "/readyz":
        return None
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, TypeError, KeyError):
        raise AssertionError(f"{response.status_code} is not an OpenAI error object: {response.content[:200]!r}") \
            from None
    if not (isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
            and {"param", "code"} <= error.keys()):
        raise AssertionError(f"{response.status_code}: malformed OpenAI error object: {error!r}")
    return None


def map_case(context, case):
    """Aims the valid generation requests at the served model, so they pass its admission checks (a random
    model name would end 404 before them); invalid ones keep theirs."""
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    if positive and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
    return case


@dataclass
class Target:
    app: object
    headers: dict[str, str]


@contextmanager
def gateway(redis_url: str) -> Iterator[Target]:
    """The gateway app on `redis_url`, with a fresh API key and `MODEL` served without a live worker, its context
    past any `max_tokens` the document allows (a prompt past a real model's context is a 400 no schema can
    foresee). The app's Redis client connects on the loop that first uses it: Schemathesis' ASGI transport's."""
    from gateway.app import create_app  # here: `tokenfleet` imports every bench module to build its parser
    from services.base import protocol as p
    from services.base.redis_client import connect
    from services.base.settings import GatewaySettings, RouterSettings, StreamSettings
    from services.tenancy.auth import register_key

    async def setup() -> str:
        redis = connect(redis_url)
        try:
            await redis.hset(p.MODELS_KEY, MODEL, p.ModelInfo(name=MODEL, model_dir="/nowhere",
                                                               max_model_len=2**31).model_dump_json())
            return await register_key(redis, TENANT)
        finally:
            await redis.aclose()

    async def teardown() -> None:
        redis = connect(redis_url)
        try:
            await redis.hdel(p.MODELS_KEY, MODEL)
        finally:
            await redis.aclose()

    key = asyncio.run(setup())
    try:
        tiers = RouterSettings(small_model=MODEL, large_model=MODEL)  # model="auto" lands on it too
        app = create_app(connect(redis_url), GatewaySettings(), tiers, StreamSettings())
        yield Target(app, {"Authorization": f"Bearer {key}"})
    finally:
        asyncio.run(teardown())


def load_schema(target: Target, **config):
    """The app's OpenAPI document as Schemathesis tests it: `CONFIG`, updated with `config`."""
    import schemathesis
    from schemathesis.config import SchemathesisConfig

    settings = SchemathesisConfig.from_dict({**CONFIG, **config, "headers": target.headers})
    settings.cache.enabled = False  # no .schemathesis/ folder
    schema = schemathesis.openapi.from_asgi("/openapi.json", target.app, config=settings)
    schema.hook(map_case)
    return schema


@dataclass
class Report:
    cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)  # by check
    examples: list[str] = field(default_factory=list)  # one failure of each check and operation, to reproduce

    def summary(self) -> dict:
        return {"cases": self.cases, "statuses": dict(sorted(self.statuses.items())), "failures": dict(self.failures)}


def fuzz(target: Target, examples: int, seed: int | None = None) -> Report:
    """Every phase Schemathesis' CLI runs (explicit examples, boundary values and unexpected methods, random
    valid and invalid data), `examples` random cases per operation (valid and invalid), going on after failures."""
    import schemathesis
    from schemathesis.engine import events, from_schema

    schemathesis.check(openai_error_object)
    schema = load_schema(target, **{"continue-on-failure": True, **({"seed": seed} if seed is not None else {}),
                                    "generation": {**CONFIG["generation"], "max-examples": examples}})
    report, seen = Report(), set()
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            report.cases += len(event.recorder.cases)
            report.statuses.update(str(i.response.status_code) for i in event.recorder.interactions.values()
                                   if i.response is not None)
            for check in (c for checks in event.recorder.checks.values() for c in checks):
                if check.status.value == "failure" and check.failure_info is not None:
                    report.failures[check.name] += 1
                    if (check.name, event.label) not in seen:
                        seen.add((check.name, event.label))
                        failure = check.failure_info.failure
                        report.examples.append(f"{event.label} {check.name}: {failure.title}\n{failure.message}\n"
                                               f"{check.failure_info.code_sample}")
        elif isinstance(event, events.FatalError | events.NonFatalError):
            report.failures[f"error: {type(event).__name__}"] += 1
            where = f"{event.label} ({event.phase})" if isinstance(event, events.NonFatalError) else "the run"
            report.examples.append(f"{where}: " + (event.info.format() if isinstance(event, events.NonFatalError)
                                                   else repr(event.exception)))
    return report


def run(examples: int, redis_url: str | None, seed: int | None = None) -> dict:
    for noisy in ("python_multipart", "services.text.prompt_encoder"):  # a warning per malformed form; no tokenizer
        logging.getLogger(noisy).setLevel(logging.ERROR)
    started = time.perf_counter()
    with _redis(redis_url) as url, gateway(url) as target:
        report = fuzz(target, examples, seed)
    for example in report.examples:
        print(example, end="\n\n", file=sys.stderr)
    return {"examples": examples, **report.summary(), "seconds": round(time.perf_counter() - started, 1)}


@contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    from services.base.redis_client import EmbeddedRedis

    embedded = EmbeddedRedis()
    try:
        yield embedded.url
    finally:
        embedded.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--examples", type=int, default=2000,
                        help="random cases per operation, valid and invalid (beside the boundary values)")
    parser.add_argument("--redis-url", default=None, help="default: REDIS_URL, else an embedded Redis")
    parser.add_argument("--seed", type=int, default=None)


def run_from_args(args: argparse.Namespace) -> int:
    from services.base.settings import RedisSettings

    result = run(args.examples, args.redis_url or RedisSettings().redis_url, args.seed)
    print(json.dumps(result, indent=2))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    script_main(__doc__, add_arguments, run_from_args)
