"""Keep start-up's long-lived objects out of the garbage collector's passes.

A full collection walks every tracked object: after loading a model that is ~360 000 objects and took
135 ms here (the gateway's ~65 000: 19 ms), during which the event loop and the engine thread stand still,
which is the stack's tail latency. Objects alive at the end of start-up live as long as the process:
`gc.freeze()` moves them out of collection for good.
"""

import asyncio
import faulthandler
import gc
import signal
import sys


def freeze_startup_objects() -> None:
    gc.collect()
    gc.freeze()


def started() -> asyncio.Event:
    """Call once a service has started (in its event loop): freezes start-up's objects and returns an event
    that SIGTERM or SIGINT sets, on which the service stops (draining first where it has work in hand).
    Where a service that does not stop is stuck: SIGUSR1 prints every thread's stack to stderr (from C, so also
    when the event loop itself is blocked), SIGUSR2 every asyncio task's (what each coroutine awaits)."""
    freeze_startup_objects()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR2, print_tasks)
    return stop


def print_tasks() -> None:
    """Each task with the chain of coroutines it awaits, innermost last (a task's own stack stops at its
    outermost coroutine)."""
    for task in asyncio.all_tasks():
        print(f"{task!r}", file=sys.stderr)
        awaited = task.get_coro()
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is not None:
                print(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}',
                      file=sys.stderr)
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    sys.stderr.flush()
