"""The engine for servers: a step loop on its own thread, per-request async token streams.

Requests and aborts reach the loop through a queue and are applied between steps; each step's
outputs go back to the event loop of the caller. Cancelling a stream (a client that disconnects)
aborts the request, which frees its KV blocks and adapter slot at the next step boundary.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from lora_guard.engine.llm_engine import LLMEngine
from lora_guard.engine.outputs import RequestOutput
from lora_guard.engine.sampling import SamplingParams

log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.05
_LOAD_WAIT_S = 0.001


class EngineDeadError(RuntimeError):
    """The step loop stopped; no request can complete."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    adapter_id: str | None
    tenant_id: str
    stream: _Stream
    arrival_time: float  # TTFT and queue time count the wait for the loop thread


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: Future[Any]


class _Stream:
    """Carries one request's outputs (or its error) from the loop thread to its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand ``item`` to the caller's event loop; False if that loop has closed."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.clock = engine, engine.clock  # the engine's clock: arrivals count on it
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="lora-guard-engine", daemon=True)
        self.error: BaseException | None = None
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._commands.put(None)
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.shutdown()

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        adapter_id: str | None = None,
        *,
        request_id: str | None = None,
        tenant_id: str = "default",
        arrival_time: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's state after every step that changed it; the last one is finished.

        ``arrival_time`` (on :attr:`clock`) is when the request reached the caller, such as
        the HTTP server; by default, now. Raises the engine's refusals before the first output:
        :class:`RequestError`, or its :class:`UnknownAdapterError` for an adapter the engine does
        not know (asked on the loop thread, and nowhere before).
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop())
        self._send(
            _Add(
                request_id,
                prompt,
                params or SamplingParams(),
                adapter_id,
                tenant_id,
                stream,
                self.clock() if arrival_time is None else arrival_time,
            )
        )
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._send(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the loop thread between two steps and return its result (the
        engine is not thread-safe: admin changes go through here)."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        future: Future[Any] = Future()
        self._send(_Call(fn, future))
        return await asyncio.wrap_future(future)

    def _send(self, command: _Add | _Abort | _Call) -> None:
        self._commands.put(command)
        self._wake.set()

    # loop thread
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if not stream.put(out):
                        # Nobody can read it any more (its event loop closed): stop the request.
                        del self._streams[out.request_id]
                        self.engine.abort(out.request_id)
                    elif out.finished:
                        del self._streams[out.request_id]
                if not outputs:
                    self._wake.wait(_LOAD_WAIT_S)
                    self._wake.clear()
        except BaseException as exc:  # the loop must never die silently
            log.exception("engine loop died")
            self.error = exc
            dead = EngineDeadError(f"the engine loop died: {exc}")
            for stream in self._streams.values():
                stream.put(dead)
            self._streams.clear()
            self._drain_after_death(dead)
        finally:
            for request_id in list(self.engine.requests):
                self.engine.abort(request_id)
            stopping = EngineDeadError("the engine is shutting down")
            for stream in self._streams.values():
                stream.put(stopping)
            self._streams.clear()
            self._drain_after_death(stopping)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is None:
                continue
            if isinstance(command, _Call):
                try:
                    command.future.set_result(command.fn(self.engine))
                except Exception as exc:
                    command.future.set_exception(exc)
                continue
            if isinstance(command, _Abort):
                self._streams.pop(command.request_id, None)
                self.engine.abort(command.request_id)
                continue
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt,
                    command.params,
                    command.adapter_id,
                    command.tenant_id,
                    arrival_time=command.arrival_time,
                )
            except Exception as exc:
                command.stream.put(exc)
            else:
                self._streams[command.request_id] = command.stream

    def _drain_after_death(self, error: EngineDeadError) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.stream.put(error)
            elif isinstance(command, _Call):
                command.future.set_exception(error)
