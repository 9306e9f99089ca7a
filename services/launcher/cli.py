"""`tokenfleet`: the one console script. Each subcommand is a thin call into the module that owns it."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

SPECULATIVE_HELP = ('speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4}; methods: '
                    'ngram, draft (with "model": a draft checkpoint), self-int8, self-int4')


def _generate(args: argparse.Namespace) -> int:
    from gpu_worker.engine import EngineConfig, InvalidRequestError, LLMEngine, ModelLoadError, SamplingParams

    try:
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                                        speculative=json.loads(args.speculative_config or "null")))
    except (ModelLoadError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    prompt = (engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
              if args.chat else args.prompt)
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                                seed=args.seed)
        engine.add_request("cli", prompt, params)
    except InvalidRequestError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            delta = out.outputs[0].text
            text.append(delta)
            if args.stream:
                print(delta, end="", flush=True)
    print("" if args.stream else "".join(text))
    return 0


def _from_module(module: str, function: str = "run_from_args"):
    """A subcommand that imports its module only when it runs (bench peers, torch, scikit-learn)."""

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), function)(args)

    return run


class _BenchmarkParser(argparse.ArgumentParser):
    """A benchmark's command line, its arguments added only when it is parsed: the benchmark's module (torch, its
    peers) is imported by `tokenfleet bench NAME`, not by every process the console script starts."""

    def __init__(self, *args, module: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.module, self.has_arguments = module, False

    def parse_known_args(self, args=None, namespace=None):
        if not self.has_arguments:
            importlib.import_module(self.module).add_arguments(self)
            for action in self._actions:  # an option with no help text would not show its default
                if action.help is None and action.default not in (None, False, argparse.SUPPRESS):
                    action.help = "(default: %(default)s)"
            self.has_arguments = True
        return super().parse_known_args(args, namespace)


# `tokenfleet bench NAME`: module (with add_arguments and run_from_args), help: the benchmarks a user runs, each
# naming what ours is set against. Experiments on the engine's parts are in bench/lab, not commands.
BENCHMARKS = {
    "engine": ("bench.engine", "our engine vs HF generate, vLLM and llama.cpp: batch-1 decode and mixed-batch "
                               "tokens/s, in interleaved rounds"),
    "serving": ("bench.serving", "our gateway vs any OpenAI-compatible server (vllm serve) under Poisson arrivals: "
                                 "TTFT, TPOT, throughput, goodput"),
    "prefix": ("bench.prefix", "prefix caching on vs off: TTFT of requests sharing a long system prompt"),
    "routing": ("bench.routing", "cache- and load-aware routing vs round robin, two workers: throughput, TTFT, "
                                 "cache hits"),
    "semantic-cache": ("bench.semantic_cache", "our semantic cache vs the bare embedding threshold and GPTCache's "
                                               "0.8: right and wrong hits on the shipped pairs"),
    "quality": ("bench.quality", "our engine vs a reference (HF transformers, or another dtype): perplexity, greedy "
                                 "agreement, task accuracy"),
    "quant": ("bench.quant", "int8 / int4 weights vs bf16 and llama.cpp's q8_0 / q4_0: bytes, quality, speed"),
    "spec": ("bench.spec", "speculative decoding (n-gram, draft models) vs none: speedup and acceptance, quote and "
                           "chat prompts"),
    "router": ("bench.router_capacity", "the router vs the request rate it is given: decision delay and rate "
                                        "forwarded, by concurrency"),
    "soak": ("bench.soak", "the whole stack for minutes vs its own first minutes: every service's RSS slope, p99, "
                           "nothing lost"),
    "gpu": ("bench.gpu", "our engine on a GPU vs HF generate and the HBM roofline: batch-1 decode, concurrent "
                         "requests, Triton kernels"),
    "kv-window": ("bench.kv_window", "sliding-window and hybrid attention vs full attention: KV a sequence holds "
                                     "at 1x to 8x its window"),
    "faults": ("bench.faults", "`tokenfleet up` through a Redis kill and a whole-stack kill vs what its clients got: "
                               "recovery, ledger rows"),
}


def _redis_url() -> str:
    """REDIS_URL, else the Redis of the `tokenfleet up` running from this cache directory."""
    from services.base.settings import RedisSettings
    from services.launcher.stack import running_stack

    url = RedisSettings().redis_url or (running_stack() or {}).get("redis_url")
    if not url:
        raise SystemExit("REDIS_URL is not set and no `tokenfleet up` is running here: set REDIS_URL to the "
                         "stack's Redis, or start `tokenfleet up`")
    return url


def _run_service(name: str, serve, settings) -> int:
    import asyncio
    import logging

    from services.base import telemetry

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    telemetry.configure(name)
    try:  # uvloop where installed: every hop of a request wakes an event loop
        from uvloop import run
    except ImportError:
        run = asyncio.run
    run(serve(settings, _redis_url()))
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from gateway.main import serve
    from services.base.settings import GatewaySettings

    overrides = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    return _run_service("gateway", serve, GatewaySettings(**overrides))


def _router(args: argparse.Namespace) -> int:
    import asyncio

    from router.main import is_alive, serve
    from services.base.settings import RouterSettings

    if args.check:
        return 0 if asyncio.run(is_alive(_redis_url())) else 1
    return _run_service("router", serve, RouterSettings())


def _accounting(args: argparse.Namespace) -> int:
    from services.accounting.main import serve
    from services.base.settings import AccountingSettings

    if args.migrate:
        from services.accounting import db

        db.migrate(db.connect(AccountingSettings().ledger_url()))
        return 0
    return _run_service("accounting", serve, AccountingSettings())


def _celery(args: argparse.Namespace) -> int:
    from services.base.settings import AccountingSettings
    from services.jobs.tasks import run_worker

    return run_worker(AccountingSettings(), _redis_url())


def _worker(args: argparse.Namespace) -> int:
    from gpu_worker.main import serve
    from services.base.settings import WorkerSettings

    flags = {"model": args.model, "served_model_name": args.served_model_name, "device": args.device,
             "dtype": args.dtype, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
             "speculative": args.speculative_config, "tier": args.tier,
             "metrics_port": args.metrics_port}
    return _run_service("worker", serve, WorkerSettings(**{k: v for k, v in flags.items() if v is not None}))


def _up(args: argparse.Namespace) -> int:
    from services.base.settings import GatewaySettings
    from services.launcher.stack import default_workers, up

    gateway = GatewaySettings()
    return up(args.host or gateway.host, args.port or gateway.port, default_workers(), console_logs=args.logs)


def _keys_create(args: argparse.Namespace) -> int:
    import asyncio

    from services.tenancy.auth import register_key

    def create(redis):
        return register_key(redis, args.name, cache_mode=args.cache, rpm=args.rpm, tpm=args.tpm,
                            budget_usd=args.budget_usd, budget_period=args.budget_period, admin=args.admin,
                            sla_class=args.sla, prefix_group=args.prefix_group)

    print(asyncio.run(_with_redis(create)))
    return 0


def _keys_list(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from services.tenancy.auth import list_keys

    keys = asyncio.run(_with_redis(list_keys))
    print(f"{'id':12}  {'name':24}  {'created (UTC)':19}  limits")
    for key_id, record in keys:
        limits = ", ".join(f"{name} {record[name]}" for name in ("rpm", "tpm", "budget_usd", "budget_period",
                                                                 "sla_class", "prefix_group", "cache")
                           if record.get(name) is not None) + (", admin" if record.get("admin") else "")
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(record.get("created", 0)))
        print(f"{key_id:12}  {record['name']:24}  {created:19}  {limits.strip(', ') or 'none'}")
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    import asyncio

    from services.tenancy.auth import revoke_key

    try:
        name = asyncio.run(_with_redis(lambda redis: revoke_key(redis, args.key)))
    except ValueError as exc:
        raise SystemExit(f"tokenfleet keys revoke: {exc}") from None
    print(f"revoked a key of {name}")
    return 0


async def _with_redis(work):
    from services.base.redis_client import connect

    redis = connect(_redis_url())
    try:
        return await work(redis)
    finally:
        await redis.aclose()


def _add_service_commands(sub) -> None:
    up = sub.add_parser("up", help="the whole stack as local processes (embedded Redis unless REDIS_URL is set)")
    up.add_argument("--host", default=None, help="the gateway's (default: TOKENFLEET_GATEWAY_HOST, 127.0.0.1)")
    up.add_argument("--port", type=int, default=None, help="the gateway's (default: TOKENFLEET_GATEWAY_PORT, 8000); "
                    "the finance API takes the next one unless TOKENFLEET_ACCOUNTING_PORT is set")
    up.add_argument("--logs", action="store_true",
                    help="every service's output on this console, instead of a file each in the cache directory")
    up.set_defaults(func=_up)

    gateway = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    gateway.add_argument("--host", default=None)
    gateway.add_argument("--port", type=int, default=None)
    gateway.set_defaults(func=_gateway)

    router = sub.add_parser("router", help="the router (request stream -> model work streams)")
    router.add_argument("--check", action="store_true",
                        help="exit 0 if a router on this host read the request stream in the last 30 s (a healthcheck)")
    router.set_defaults(func=_router)
    router_sub = router.add_subparsers(dest="router_command")  # optional: a bare `tokenfleet router` serves
    from router.train import add_arguments as add_train_arguments

    train = router_sub.add_parser("train", help="fit the model=auto tier classifier on labeled prompts (JSONL)")
    add_train_arguments(train)
    train.set_defaults(func=_from_module("router.train", "main"))

    accounting = sub.add_parser("accounting", help="the ledger: completion events -> cost and SLA rows "
                                                   "(DATABASE_URL or SQLite)")
    accounting.add_argument("--migrate", action="store_true",
                            help="bring the ledger's schema up to date and exit (a one-shot deploy step)")
    accounting.set_defaults(func=_accounting)
    sub.add_parser("celery", help="the ledger's background jobs (rollups, retention) with their schedule (beat)"
                   ).set_defaults(func=_celery)

    worker = sub.add_parser("worker", help="a GPU worker serving one model")
    worker.add_argument("--model", default=None, help="a model name, an HF model directory or a .gguf file")
    worker.add_argument("--served-model-name", default=None)
    worker.add_argument("--device", default=None)
    worker.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    worker.add_argument("--quantization", default=None,
                        help="int8 / int4: quantize the weights at load time (a quantized checkpoint needs no flag)")
    worker.add_argument("--kv-cache-dtype", default=None, help="auto (the serving dtype), int8, or fp8 (CUDA)")
    worker.add_argument("--speculative-config", default=None, help=SPECULATIVE_HELP)
    worker.add_argument("--tier", default=None, help="small / large: the tiers model=auto chooses between")
    worker.add_argument("--metrics-port", type=int, default=None)
    worker.set_defaults(func=_worker)

    quantize = sub.add_parser("quantize", help="write an int8 / int4 copy of a checkpoint that serves with no flag")
    quantize.add_argument("--model", required=True, help="a model name, an HF directory or a .gguf file")
    quantize.add_argument("--method", required=True, choices=["int8", "int4", "bf16"],
                          help="bf16: a plain dense copy (e.g. of a GGUF file's dequantized weights)")
    quantize.add_argument("--group-size", type=int, default=128, help="int4: inputs per group of one scale")
    quantize.add_argument("--table", choices=["int8", "int4"], default=None,
                          help="the embedding table's method (default: int8 where the LM head shares it, as "
                               "llama.cpp keeps it; else --method)")
    quantize.add_argument("--calibration", type=Path, default=None,
                          help="int4: text whose activations choose the AWQ scales (default: a shipped sample)")
    quantize.add_argument("--out", type=Path, required=True)
    quantize.set_defaults(func=_from_module("gpu_worker.quantize.convert", "main"))

    keys = sub.add_parser("keys", help="API keys")
    keys_sub = keys.add_subparsers(dest="keys", required=True)
    create = keys_sub.add_parser("create", help="create a key (printed once; stored hashed)")
    create.add_argument("name", help="the tenant: response caches (and the ledger) are kept per name")
    create.add_argument("--cache", choices=["off", "exact", "semantic"], default=None,
                        help="response caches for this key's requests that choose none (default: the deployment's)")
    create.add_argument("--rpm", type=int, default=None, help="requests per minute (default: unlimited)")
    create.add_argument("--tpm", type=int, default=None,
                        help="tokens per minute: estimated prompt tokens + max_tokens (default: unlimited)")
    create.add_argument("--budget-usd", type=float, default=None,
                        help="list-price spending per --budget-period, never exceeded (default: unlimited)")
    create.add_argument("--budget-period", choices=["day", "month", "total"], default="month",
                        help="the budget's period: a UTC day or month, or the key's lifetime")
    create.add_argument("--sla", default=None, help="SLA class of its requests that name none (e.g. batch)")
    create.add_argument("--prefix-group", default=None,
                        help="keys with the same group share prefix-cache hits (default: only the key's own name)")
    create.add_argument("--admin", action="store_true",
                        help="the finance API shows this key every tenant's ledger (others: their own)")
    create.set_defaults(func=_keys_create)
    keys_sub.add_parser("list", help="every key's id, name, creation time and limits (keys are stored hashed: "
                                     "never shown again)").set_defaults(func=_keys_list)
    revoke = keys_sub.add_parser("revoke", help="delete a key: its requests are refused from then on")
    revoke.add_argument("key", help="the key itself, or its id from `tokenfleet keys list`")
    revoke.set_defaults(func=_keys_revoke)


class _WithDefaults(argparse.HelpFormatter):
    """`--help` shows each option's default after its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenfleet", description="tokenfleet LLM serving stack")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt with the engine")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="smollm2-135m-instruct",
                     help="a model name, an HF model directory or a .gguf file")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--quantization", default=None, help="int8 / int4: quantize the weights at load time")
    gen.add_argument("--kv-cache-dtype", default="auto", help="auto (the serving dtype), int8, or fp8 (CUDA)")
    gen.add_argument("--speculative-config", default=None, help=SPECULATIVE_HELP)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="benchmarks against peers", description=(
        "Benchmarks against peers. Each writes its figures to bench/results/<benchmark>-<host family>.json (the "
        "latest run on this kind of host; --json elsewhere); engine and serving also draw them beside it (.png)."))
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=_BenchmarkParser)
    for name, (module, text) in BENCHMARKS.items():
        command = bench_sub.add_parser(name, module=module, help=text, description=text,
                                       formatter_class=_WithDefaults)
        command.set_defaults(func=_from_module(module))
    _add_service_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
