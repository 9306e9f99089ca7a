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

from services.base.asyncio_tasks import keep_cancellations, print_tasks


def freeze_startup_objects() -> None:
    gc.collect()
    gc.freeze()


def started() -> asyncio.Event:
    """Call once a service has started (in its event loop): freezes start-up's objects, keeps cancellations
    from being lost (see `keep_cancellations`) and returns an event that SIGTERM or SIGINT sets, on which the
    service stops (draining first where it has work in hand).
    Where a service that does not stop is stuck: SIGUSR1 prints every thread's stack to stderr (from C, so also
    when the event loop itself is blocked), SIGUSR2 every asyncio task's (what each coroutine awaits)."""
    freeze_startup_objects()
    keep_cancellations()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR2, print_tasks)
    return stop
