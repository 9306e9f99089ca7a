"""`AsyncLLMEngine`: the engine stepped by one background task; `generate` yields deltas as they come.

Steps run in a worker thread (torch releases the GIL), so the event loop keeps serving while the model
computes. Requests are added and aborted only between steps, on the loop's thread: the engine is never
touched by two threads at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.text.errors import InvalidRequestError

from .config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .sequence import ResumedChoice


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}  # open `generate` calls
        # Adds and aborts, applied between steps in the order they came: a request resumed under its own id
        # right after its abort (its worker lost Redis for a moment) must find the old one gone.
        self._pending: list[tuple[str, list[int], SamplingParams, dict, asyncio.Queue] | str] = []
        # The streams of requests the engine holds: outputs of a step that ran while a request was aborted and
        # added again go nowhere, not to the new one.
        self._live: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._step_in_flight: asyncio.Future | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0, resume: list[ResumedChoice] | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields `RequestOutput` deltas until the request finishes; leaving early aborts it.
        `resume` and `cache_salt` as in `LLMEngine.add_request`."""
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        prompt_ids = self.engine.encode_prompt(prompt)  # bad input raises here, before anything is queued
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        self._pending.append((request_id, prompt_ids, params,
                              {"priority": priority, "resume": resume, "cache_salt": cache_salt}, queue))
        self._ensure_loop()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if self._live.get(request_id) is queue:
                del self._live[request_id]
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._pending.append(request_id)
        self._wake.set()

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for operation in pending:
            if isinstance(operation, str):
                self.engine.abort_request(operation)
                continue
            request_id, prompt, params, options, queue = operation
            if self._streams.get(request_id) is not queue:  # its caller left before it was added
                continue
            try:
                self.engine.add_request(request_id, prompt, params, **options)
            except Exception as exc:  # the caller gets its error; the loop serves the others
                queue.put_nowait(exc)
                continue
            self._live[request_id] = queue

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        queue = self._live.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    async def _run(self) -> None:
        while True:
            self._apply_pending()
            if not self.engine.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                # Shielded: cancelling the loop must not abandon a step that is still running in its thread.
                self._step_in_flight = asyncio.ensure_future(asyncio.to_thread(self.engine.step))
                outputs = await asyncio.shield(self._step_in_flight)
            except Exception as exc:  # a broken step fails its requests, not the loop
                for request_id in list(self.engine.requests):
                    self._deliver(request_id, exc)
                    self.engine.abort_request(request_id)
                continue
            for output in outputs:
                self._deliver(output.request_id, output)

    async def shutdown(self) -> None:
        """Stops the loop after any step in flight, failing the streams still open."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._step_in_flight is not None:
            with contextlib.suppress(Exception):
                await self._step_in_flight
        for request_id, queue in list(self._streams.items()):
            queue.put_nowait(RuntimeError("engine shut down"))
            self.engine.abort_request(request_id)
