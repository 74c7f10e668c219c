"""Async <-> engine-thread hand-off for the single generation slot.

One thread builds and owns the Engine (all MLX state lives there). Requests wait in a bounded
FIFO queue; each job carries its own asyncio.Queue into which the engine thread drops Step records
through loop.call_soon_threadsafe. A job holds one or more requests (the choices of n > 1 or of a
batched prompt), run back to back in one queue slot; each request's last Step has a finish_reason.
Cancelling a request (client gone, stop string seen) sets its cancel event: a running generation
stops at the next round, a queued one is dropped when dequeued.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.types import GenerationRequest, Stats, Step

log = logging.getLogger("spruce.bridge")
DEFAULT_MAX_QUEUE = 32


class QueueFullError(Exception):
    """More requests are waiting than the queue holds."""


class EngineFailure(Exception):
    """The engine raised while serving a request; the engine thread itself lives on."""

    def __init__(self, message: str, bad_request: bool = False):
        super().__init__(message)
        self.bad_request = bad_request  # the engine refused the request (ValueError), not a crash


@dataclass
class Finished:
    """A record of a completed job, kept for /health and tests."""

    request_id: str
    finish_reason: str
    generated_tokens: int
    ran: bool  # False when it was cancelled while still queued


@dataclass
class Job:
    requests: list[GenerationRequest]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Step | EngineFailure

    def cancel(self) -> None:
        for request in self.requests:
            request.cancel.set()

    async def next_step(self) -> Step:
        item = await self.events.get()
        if isinstance(item, EngineFailure):
            raise item
        return item


class EngineBridge:
    """Owns the engine thread. start() blocks until the engine is loaded (or raises its load error)."""

    def __init__(self, engine_factory: Callable[[], object], max_queue: int = DEFAULT_MAX_QUEUE):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self._factory = engine_factory
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="spruce-engine", daemon=True)
        self.engine = None
        self._pending = 0  # submitted jobs not yet finished (queued or running)
        self._pending_lock = threading.Lock()
        self.history: deque[Finished] = deque(maxlen=64)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the running job; queued jobs are cancelled."""
        self._drain_queue()
        self._queue.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.engine is not None

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def waiting(self) -> list[GenerationRequest]:
        """The queued requests, oldest first (a snapshot)."""
        with self._queue.mutex:
            return [r for job in self._queue.queue if job is not None for r in job.requests]

    @property
    def idle(self) -> bool:
        return self._pending == 0

    def submit(self, requests: list[GenerationRequest]) -> Job:
        """Queue requests (run back to back) from the event loop; raises QueueFullError at capacity."""
        job = Job(list(requests), asyncio.get_running_loop())
        with self._pending_lock:
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise QueueFullError(f"{self._queue.maxsize} requests are already waiting") from None
            self._pending += 1
        return job

    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as e:  # reported to start() in the caller's thread
            self._load_error = e
            return
        finally:
            self._ready.set()
        while (job := self._queue.get()) is not None:
            try:
                self._serve(job)
            finally:
                self._done()

    def _done(self) -> None:
        with self._pending_lock:
            self._pending -= 1

    def _serve(self, job: Job) -> None:
        for req in job.requests:
            if not self._serve_one(job, req):
                return  # a failure ends the job: its consumer stops reading

    def _serve_one(self, job: Job, req: GenerationRequest) -> bool:
        if req.cancel.is_set():
            self._finish(job, req, Step([], "cancelled", Stats(prompt_tokens=len(req.prompt_ids))), ran=False)
            return True
        try:
            steps = self.engine.generate(req)  # checks the request eagerly: ValueError = the client's fault
        except ValueError as e:
            self._fail(job, req, EngineFailure(str(e), bad_request=True))
            return False
        last = None
        try:
            for step in steps:
                last = step
                if step.finish_reason is not None:
                    break
                self._deliver(job, step)
        except Exception as e:  # the thread must outlive any single request
            log.exception("engine failed on request %s", req.request_id)
            self._fail(job, req, EngineFailure(f"engine error: {type(e).__name__}: {e}"))
            return False
        finally:
            # A generator left suspended would run its cleanup (MLX work) on whatever thread
            # collects it; close it here, on the engine thread.
            close = getattr(steps, "close", None)
            if close is not None:
                close()
        if last is None or last.finish_reason is None:
            self._fail(job, req, EngineFailure("engine ended a generation without a finish reason"))
            return False
        self._finish(job, req, last, ran=True)
        return True

    def _finish(self, job: Job, req: GenerationRequest, step: Step, ran: bool) -> None:
        generated = step.stats.generated_tokens if step.stats else 0
        self.history.append(Finished(req.request_id, step.finish_reason, generated, ran))
        self._deliver(job, step)

    def _fail(self, job: Job, req: GenerationRequest, failure: EngineFailure) -> None:
        self.history.append(Finished(req.request_id, "error", 0, True))
        self._deliver(job, failure)

    def _deliver(self, job: Job, item: Step | EngineFailure) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down): stop this job
            job.cancel()

    def _drain_queue(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.cancel()
                for req in job.requests:
                    self._finish(job, req, Step([], "cancelled", Stats()), ran=False)
                self._done()
