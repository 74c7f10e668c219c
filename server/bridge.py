"""Async <-> engine-thread hand-off for the single generation slot.

One thread builds and owns the Engine (all MLX state lives there). Requests wait in a bounded
FIFO queue; each job carries its own asyncio.Queue into which the engine thread drops Step records
through loop.call_soon_threadsafe. A job holds one or more requests (the choices of n > 1 or of a
batched prompt), run back to back in one queue slot; each request's last Step has a finish_reason.

Every waiting client gets an answer, whatever happens:
- a client that goes away while queued frees its slot at once (Job.cancel withdraws the job);
  a running generation stops at the engine's next round;
- an exception from the engine fails that job alone (500), and the thread serves the next one;
- if the thread ends anyway, the job it held and every queued job are failed, later submits get
  503 and `alive` turns false (/health reports it);
- shutdown fails the queued jobs with 503 at once and gives the running one a grace period,
  after which it is cut with a 503 failure that says why.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.types import GenerationRequest, Stats, Step

if TYPE_CHECKING:
    from engine.generate import Engine

log = logging.getLogger("spruce.bridge")
DEFAULT_MAX_QUEUE = 32
SHUTDOWN_CODE = "server_shutting_down"


class QueueFullError(Exception):
    """More requests are waiting than the queue holds."""


class Unavailable(Exception):
    """The engine takes no new work: it stopped after a fault, or the server is shutting down."""


class EngineFailure(Exception):
    """A job ended without an answer: the engine refused it (400), failed on it (500), or it was
    cut or never run because the server stopped (503)."""

    def __init__(self, message: str, status: int = 500, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code

    @property
    def bad_request(self) -> bool:
        return self.status == 400


@dataclass
class Finished:
    """A record of a completed job, kept for /health and tests."""

    request_id: str
    finish_reason: str | None
    generated_tokens: int
    ran: bool  # False when it was cancelled while still queued


@dataclass(eq=False)
class Job:
    requests: list[GenerationRequest]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Step | EngineFailure
    cut_reason: str | None = None  # set when shutdown cuts this job while it runs
    _withdraw: Callable[[Job], None] | None = None

    def cancel(self) -> None:
        """Stop this job: a running one at the engine's next round, a queued one leaves the queue now."""
        for request in self.requests:
            request.cancel.set()
        if self._withdraw is not None:
            self._withdraw(self)

    async def next_step(self) -> Step:
        item = await self.events.get()
        if isinstance(item, EngineFailure):
            raise item
        return item


class EngineBridge:
    """Owns the engine thread. start() blocks until the engine is loaded (or raises its load error)."""

    def __init__(self, engine_factory: Callable[[], Engine], max_queue: int = DEFAULT_MAX_QUEUE):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self._factory = engine_factory
        self.max_queue = max_queue
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._closing = False  # shutdown began: no new jobs, the thread ends after the running one
        self._fault: str | None = None  # why the thread ended early
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="spruce-engine", daemon=True)
        self._cut_timer: threading.Timer | None = None
        self.engine: Engine | None = None
        self.history: deque[Finished] = deque(maxlen=64)

    # ---- lifecycle (caller's thread) ----

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            error, self._load_error = self._load_error, None
            raise error

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new jobs, fail the queued ones (503), and let the running one finish for up to
        grace_s seconds before it is cut. Safe from any thread; calling it again only shortens the grace."""
        with self._cond:
            self._closing = True
            queued = list(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        for job in queued:
            self._fail_job(job, EngineFailure("the server is shutting down; this request was not run "
                                              "(retry on a new server)", 503, SHUTDOWN_CODE))
        if self._cut_timer is not None:
            self._cut_timer.cancel()
        if grace_s <= 0:
            self._cut_running()
            return
        self._cut_timer = threading.Timer(grace_s, self._cut_running)
        self._cut_timer.daemon = True
        self._cut_timer.start()

    def stop(self, timeout: float = 10.0) -> bool:
        """Shut down now (queued jobs fail, the running one is cut) and wait for the thread.
        -> whether the thread has ended."""
        self.begin_shutdown(0)
        return self.join(timeout)

    def join(self, timeout: float) -> bool:
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._cut_timer is not None:
            self._cut_timer.cancel()
        return not self._thread.is_alive()

    # ---- state ----

    @property
    def alive(self) -> bool:
        """The engine is loaded and takes work (false after a fault and once shutdown began)."""
        return self._thread.is_alive() and self.engine is not None and self._fault is None and not self._closing

    @property
    def status(self) -> str:
        """"loading", "ok", "shutting_down", or "stopped" (the thread ended without a shutdown: a fault)."""
        if self._closing:
            return "shutting_down"
        if not self._ready.is_set():
            return "loading"
        return "ok" if self._thread.is_alive() and self._fault is None and self.engine is not None else "stopped"

    @property
    def queued(self) -> int:
        return len(self._jobs)

    def waiting(self) -> list[GenerationRequest]:
        """The queued requests, oldest first (a snapshot)."""
        with self._cond:
            return [r for job in self._jobs for r in job.requests]

    @property
    def idle(self) -> bool:
        """No job is queued or running (the last job's final step was delivered)."""
        with self._cond:
            return not self._jobs and self._running is None

    # ---- the event loop's side ----

    def submit(self, requests: list[GenerationRequest]) -> Job:
        """Queue requests (run back to back) from the event loop. Raises QueueFullError at capacity,
        Unavailable when the engine takes no new work."""
        job = Job(list(requests), asyncio.get_running_loop(), _withdraw=self._withdraw)
        with self._cond:
            if self._closing:
                raise Unavailable("the server is shutting down")
            if self._fault is not None or not self._thread.is_alive():
                raise Unavailable("the engine is not running (it stopped after an internal error; "
                                  "see the server log)")
            if len(self._jobs) >= self.max_queue:
                raise QueueFullError(f"{self.max_queue} requests are already waiting")
            self._jobs.append(job)
            self._cond.notify()
        return job

    def _withdraw(self, job: Job) -> None:
        """A queued job whose client went away leaves the queue now, so its slot is free at once."""
        with self._cond:
            try:
                self._jobs.remove(job)
            except ValueError:
                return  # running, finished, or failed already
        for req in job.requests:
            self._finish(job, req, Step([], "cancelled", Stats(prompt_tokens=len(req.prompt_ids))), ran=False)

    # ---- the engine thread ----

    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as e:  # reported to start() in the caller's thread
            self._load_error = e
            return
        finally:
            self._ready.set()
        try:
            while (job := self._next_job()) is not None:
                self._serve(job)
                with self._cond:
                    self._running = None
        except BaseException as e:  # not an Exception (those fail one job): the thread cannot go on
            self._fault = f"{type(e).__name__}: {e}"
            log.critical("the engine thread stopped", exc_info=True)
        finally:
            self._close_down()

    def _next_job(self) -> Job | None:
        with self._cond:
            while not self._jobs and not self._closing:
                self._cond.wait()
            if not self._jobs:
                return None
            self._running = self._jobs.popleft()
            return self._running

    def _close_down(self) -> None:
        """The thread is ending: whoever still waits gets an answer."""
        with self._cond:
            running, queued = self._running, list(self._jobs)
            self._jobs.clear()
            self._running = None
        if running is not None:  # only after a fault: a normal end finishes the running job first
            self._fail_job(running, EngineFailure("the engine stopped after an internal error; see the server log"))
        reason = "the engine stopped after an internal error" if self._fault else "the server is shutting down"
        for job in queued:
            self._fail_job(job, EngineFailure(f"{reason}; this request was not run", 503,
                                              None if self._fault else SHUTDOWN_CODE))

    def _cut_running(self) -> None:
        with self._cond:
            job = self._running
            if job is None:
                return
            job.cut_reason = "the server is shutting down; the answer was cut short"
        for request in job.requests:
            request.cancel.set()

    def _serve(self, job: Job) -> None:
        for req in job.requests:
            if not self._serve_one(job, req):
                return  # a failure ends the job: its consumer stops reading

    def _serve_one(self, job: Job, req: GenerationRequest) -> bool:
        if job.cut_reason is not None:
            self._fail(job, req, EngineFailure(job.cut_reason, 503, SHUTDOWN_CODE))
            return False
        if req.cancel.is_set():
            self._finish(job, req, Step([], "cancelled", Stats(prompt_tokens=len(req.prompt_ids))), ran=False)
            return True
        steps = None
        last = None
        try:
            # generate() checks the request eagerly: a ValueError there is the client's fault
            try:
                assert self.engine is not None  # the thread serves jobs only once the engine is loaded
                steps = self.engine.generate(req)
            except ValueError as e:
                self._fail(job, req, EngineFailure(str(e), 400))
                return False
            for step in steps:
                last = step
                if step.finish_reason is not None:
                    break
                self._deliver(job, step)
        except Exception:  # the thread must outlive any single request (RuntimeError, MemoryError, ...)
            log.exception("engine failed on request %s", req.request_id)
            self._fail(job, req, EngineFailure(f"the engine failed on this request (id {req.request_id}); "
                                               "see the server log", 500))
            return False
        finally:
            # A generator left suspended would run its cleanup (MLX work) on whatever thread
            # collects it; close it here, on the engine thread.
            self._close_steps(steps, req)
        if last is None or last.finish_reason is None:
            log.error("engine ended request %s without a finish reason", req.request_id)
            self._fail(job, req, EngineFailure("the engine ended a generation without a finish reason", 500))
            return False
        if last.finish_reason == "cancelled" and job.cut_reason is not None:
            self._fail(job, req, EngineFailure(job.cut_reason, 503, SHUTDOWN_CODE))
            return False
        self._finish(job, req, last, ran=True)
        return True

    @staticmethod
    def _close_steps(steps, req: GenerationRequest) -> None:
        close = getattr(steps, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception:  # cleanup failed: the answer (or failure) is already decided
            log.exception("engine cleanup failed on request %s", req.request_id)

    def _finish(self, job: Job, req: GenerationRequest, step: Step, ran: bool) -> None:
        generated = step.stats.generated_tokens if step.stats else 0
        self.history.append(Finished(req.request_id, step.finish_reason, generated, ran))
        self._deliver(job, step)

    def _fail(self, job: Job, req: GenerationRequest, failure: EngineFailure) -> None:
        self.history.append(Finished(req.request_id, "error", 0, True))
        self._deliver(job, failure)

    def _fail_job(self, job: Job, failure: EngineFailure) -> None:
        for req in job.requests:
            req.cancel.set()
        self._fail(job, job.requests[0], failure)

    def _deliver(self, job: Job, item: Step | EngineFailure) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down): stop this job
            for request in job.requests:
                request.cancel.set()

