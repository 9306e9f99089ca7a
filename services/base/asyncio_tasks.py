"""Asyncio tasks that stop when they are cancelled, and say where they are when they do not.

Python 3.11's `asyncio.wait_for` returns the awaited call's result when the task awaiting it is cancelled in the
same pass of the event loop as the call completes (CPython gh-86296, fixed in 3.12 by rebuilding `wait_for` on
`asyncio.timeout`): the cancellation is lost, though the task stays marked "cancelling". redis-py sends every
command under `wait_for` (its socket timeout), so any task cancelled during a Redis call could go on as if never
told: a draining worker's janitor loop did, and held the drain past its deadline. A loop of back-to-back Redis
calls, cancelled at a random moment, lost 124 of 200 cancellations that way (`tests/base/test_asyncio_tasks.py`).
"""

from __future__ import annotations

import asyncio
import logging
import sys


def keep_cancellations() -> None:
    """On Python 3.11, `asyncio.wait_for` as 3.12 defines it: the awaited call under `asyncio.timeout`, so a
    cancellation reaches the caller whatever else finished in the same pass. Process-wide (redis-py looks
    `wait_for` up on the `asyncio` module at each call); once, at a service's start."""
    if sys.version_info < (3, 12):
        asyncio.wait_for = _wait_for


async def _wait_for(aw, timeout: float | None):
    if timeout is not None and timeout <= 0:  # no wait, nothing to lose: the original's path
        return await asyncio.tasks.wait_for(aw, timeout)
    async with asyncio.timeout(timeout):
        return await aw


def awaited_frames(task: asyncio.Task) -> list[str]:
    """The chain of coroutines a task awaits, outermost first, as traceback lines (a task's own stack stops at
    its outermost coroutine)."""
    lines, awaited = [], task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is not None:
            lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}')
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return lines


def print_tasks() -> None:
    """Every task of the running loop, each with what it awaits, to stderr (a service's SIGUSR2)."""
    for task in asyncio.all_tasks():
        print(f"{task!r}", *awaited_frames(task), sep="\n", file=sys.stderr)
    sys.stderr.flush()


async def cancel_and_wait(tasks, timeout_s: float, log: logging.Logger, what: str) -> set[asyncio.Task]:
    """Cancels the tasks and waits up to `timeout_s` for them to end. Returns those that did not (a cancellation
    lost in some library), each logged with where it is: a shutdown goes on without them rather than hang."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    if not tasks:
        return set()
    _, stuck = await asyncio.wait(tasks, timeout=timeout_s)
    for task in stuck:
        log.error("%s: task %s did not end within %.3g s of its cancellation; going on without it. It awaits:\n%s",
                  what, task.get_name(), timeout_s, "\n".join(awaited_frames(task)))
    return stuck
