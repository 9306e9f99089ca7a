"""`tokenfleet`: the one console script. Each subcommand is a thin call into the module that owns it."""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    from gpu_worker.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device))
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


def _bench(args: argparse.Namespace) -> int:
    from bench.engine import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenfleet", description="tokenfleet LLM serving stack")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt with the engine")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="tokenfleet-small", help="built-in name or HF model directory")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="benchmarks against peers")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from bench.engine import add_arguments

    engine_bench = bench_sub.add_parser("engine", help="our engine vs HF generate (and vLLM, llama.cpp)")
    add_arguments(engine_bench)
    engine_bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
