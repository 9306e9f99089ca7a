"""What a worker's first start spends minutes on, done by `tokenfleet up` before it starts the workers, with the
console told how long it has been: built-in checkpoints written, the CPU kernels compiled. Both land in the cache
directory, where the workers then find them ready (a silent minute looked like a hang)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from services.base.settings import WorkerSettings


@contextlib.contextmanager
def elapsed(what: str, out: TextIO = sys.stdout, every_s: float = 1.0) -> Iterator[None]:
    """`tokenfleet: <what> … 12 s`, redrawn in place each second on a terminal (a line every 10 s elsewhere, a log
    file not being a screen), then the total."""
    started, done = time.monotonic(), threading.Event()
    tty = out.isatty()

    def tick() -> None:
        while not done.wait(every_s if tty else 10 * every_s):
            line = f"tokenfleet: {what} … {time.monotonic() - started:.0f} s"
            out.write(f"\r{line}" if tty else f"{line}\n")
            out.flush()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        out.write(f"{chr(13) if tty else ''}tokenfleet: {what}: done in {time.monotonic() - started:.0f} s\n")
        out.flush()


def prepare(models: list[str], settings: WorkerSettings, out: TextIO = sys.stdout) -> None:
    from gpu_worker.engine import kernels
    from gpu_worker.engine.builtin_models import ensure_builtin
    from services.text.builtin_models import BUILTIN_MODELS, is_built

    for model in models:
        if model in BUILTIN_MODELS and not is_built(model):
            with elapsed(f"writing the {model} checkpoint (once)", out):
                ensure_builtin(model)
    # What a CPU worker loads: the bf16 kernels for this CPU and the quantized linears' (the default model is
    # served quantized); left to the worker, they compiled inside its model load with nothing on the console.
    if settings.device == "cpu" and not kernels.cpu_worker_kernels_built():
        with elapsed("compiling the CPU kernels (once per install)", out):
            kernels.build_cpu_worker_kernels()
