"""`tokenfleet up` does a worker's slow first-start work itself, telling the console how long it has been."""

from __future__ import annotations

import io
import os
import time

from services.base.settings import WorkerSettings
from services.launcher import first_start


def test_a_slow_step_shows_how_long_it_has_run_and_then_its_total():
    out = io.StringIO()  # not a terminal: a line per tick rather than one line redrawn
    with first_start.elapsed("compiling", out, every_s=0.05):
        time.sleep(1.2)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("tokenfleet: compiling … ") and lines[-1] == "tokenfleet: compiling: done in 1 s"
    assert 1 <= len(lines) - 1 <= 3  # a tick every 10 x every_s off a terminal


def test_a_built_in_checkpoint_is_written_before_the_workers_start_and_only_once(tmp_path, monkeypatch):
    from services.text.builtin_models import is_built

    monkeypatch.setenv("TOKENFLEET_CACHE_DIR", str(tmp_path))
    gpu = WorkerSettings(device="cuda")  # no CPU kernels to compile: this test is about the checkpoint
    first, again = io.StringIO(), io.StringIO()
    first_start.prepare(["tokenfleet-small", "smollm2-135m-instruct"], gpu, first)
    assert is_built("tokenfleet-small")
    said = first.getvalue().splitlines()
    assert said[-1].startswith("tokenfleet: writing the tokenfleet-small checkpoint (once): done in ")
    first_start.prepare(["tokenfleet-small"], gpu, again)
    assert again.getvalue() == ""


def test_the_cpu_kernels_to_compile_are_those_a_cpu_worker_loads(tmp_path, monkeypatch):
    from gpu_worker.engine import kernels

    kernels.build_cpu_worker_kernels()  # in the usual cache (make setup does it)
    assert kernels.cpu_worker_kernels_built()
    names = {module.name for module in kernels.cpu_worker_modules()}
    if kernels.cpu_has_avx512_bf16() and kernels.cpu_has(kernels.QUANT_VNNI_FLAGS):
        assert {"tokenfleet_quant_cpu_kernels", "tokenfleet_quant_vnni_kernels"} <= names
    avx2_only = frozenset(f for f in kernels.cpu_flags() if not f.startswith(("avx512", "amx", "avx_vnni")))
    monkeypatch.setattr(kernels, "cpu_flags", lambda: avx2_only)
    assert {module.name for module in kernels.cpu_worker_modules()} <= {"tokenfleet_avx2_kernels",
                                                                        "tokenfleet_quant_cpu_kernels"}
    monkeypatch.setenv("TOKENFLEET_CACHE_DIR", str(tmp_path))  # an install with nothing compiled
    assert kernels.cpu_worker_kernels_built() == (not kernels.cpu_has(kernels.AVX2_FLAGS))
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset())  # no vector kernels at all: nothing to compile
    assert kernels.cpu_worker_modules() == [] and kernels.cpu_worker_kernels_built()


def test_a_kernel_module_is_stale_once_a_header_it_includes_is_newer_than_it(tmp_path, monkeypatch):
    from gpu_worker.engine import kernels

    module = kernels.AVX2_MODULE
    assert {path.name for path in module.inputs()} >= {"cpu_avx2_kernels.cpp", "paged_kv.h", "elementwise.h", "vec.h"}
    assert not {path.name for path in module.inputs()} & {"amx_tiles.h", "quant_common.h"}
    monkeypatch.setattr(kernels, "_build_dir", lambda: tmp_path)
    library = module.build_dir() / f"{module.name}.so"
    library.parent.mkdir()
    library.write_bytes(b"")
    assert module.built()
    vec_h = next(path for path in module.inputs() if path.name == "vec.h")
    os.utime(library, (vec_h.stat().st_mtime - 10, vec_h.stat().st_mtime - 10))
    assert not module.built()
