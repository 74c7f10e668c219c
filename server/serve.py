"""Running the app under uvicorn: a listening socket bound before the model loads, slow and
surplus connections turned away, and a graceful, bounded shutdown on SIGTERM / SIGINT.

Shutdown (first signal): the listening socket closes, queued requests get 503 at once, and the
running generation may finish for up to --shutdown-timeout seconds; if it is still running then,
it is cut and its client gets a final event saying why (a 503 for a non-streamed request). A
second signal cuts it at once; a third stops waiting for connections. The process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import signal
import socket
import sys
import threading

import uvicorn
from sse_starlette.sse import AppStatus
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.bridge import EngineBridge
from server.http_guards import is_ip_literal

log = logging.getLogger("spruce.serve")
FINAL_EVENTS_S = 2.0  # after the grace period: time for cut streams to send their last events
_REFUSAL_BODY = (b'{"error":{"message":"too many open connections; retry later","type":"unavailable_error",'
                 b'"param":null,"code":"too_many_connections"}}')
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY)


class AddressInUse(OSError):
    pass


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket, so that a port in use is found before the model loads (and clients that
    connect while it loads wait in the backlog)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets' connections, and
    # without it a keep-alive client waits out a delayed ACK (40 ms) for every small answer
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise AddressInUse(e.errno, f"{host}:{port} is already in use (another server?); pick another --port") \
                from None
        raise
    sock.set_inheritable(True)
    return sock


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for every request head (uvicorn has none: a client
    that sends its headers a byte at a time would hold its connection forever) and a cap on open
    connections (503 beyond it)."""

    config: SpruceConfig

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = len(self.connections) >= self.config.max_connections
        if self._refused:
            self.transport = transport
            transport.write(_REFUSAL)
            transport.close()
            return
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._cycle_at_arm:
            self._cancel_head_timer()  # a request head arrived whole

    def on_response_complete(self) -> None:
        self._arm_head_timer()  # the next request on this connection gets its own deadline
        super().on_response_complete()
        if self.cycle is not self._cycle_at_arm or self.transport.is_closing():
            self._cancel_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if not self._refused:
            super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._cycle_at_arm = self.cycle
        self._head_timer = self.loop.call_later(self.config.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is self._cycle_at_arm and not self.transport.is_closing():
            self.logger.info("closing a connection that sent no complete request head within %g s",
                             self.config.head_timeout_s)
            self.transport.close()


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def is_loopback(host: str) -> bool:
    return host == "localhost" or (is_ip_literal(host) and ipaddress.ip_address(host).is_loopback)


def warn_if_exposed(host: str, api_key: str | None) -> None:
    if api_key is None and not is_loopback(host):
        print(f"spruce: warning: --host {host} makes the server reachable from other machines, and it has no "
              "--api-key: anyone who can reach this port can use it", file=sys.stderr)


class SpruceConfig(uvicorn.Config):
    def __init__(self, app, *, head_timeout_s: float = 15.0, max_connections: int = 128, **kwargs) -> None:
        super().__init__(app, http=GuardedH11Protocol, **kwargs)
        self.head_timeout_s = head_timeout_s
        self.max_connections = max_connections


class SpruceServer(uvicorn.Server):
    """uvicorn's server with Spruce's shutdown (see the module docstring). Signals are handled only
    when it runs on the main thread; request_shutdown() does the same from anywhere."""

    def __init__(self, config: SpruceConfig, bridge: EngineBridge, shutdown_timeout_s: float) -> None:
        config.timeout_graceful_shutdown = shutdown_timeout_s + FINAL_EVENTS_S  # type: ignore[assignment]
        super().__init__(config)
        self.bridge = bridge
        self.shutdown_timeout_s = shutdown_timeout_s
        self.signals_seen = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        # Streams end through the bridge (with a final event), not by sse-starlette cancelling them.
        AppStatus.disable_automatic_graceful_drain()

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """Like uvicorn's, but a signal is not raised again after the shutdown: spruce exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        self.signals_seen += 1
        if self.signals_seen == 1:
            log.warning("shutting down: waiting up to %g s for the running request", self.shutdown_timeout_s)
        elif self.signals_seen == 2:
            log.warning("shutting down now")
        self.request_shutdown(self.shutdown_timeout_s if self.signals_seen == 1 else 0.0)
        if self.signals_seen >= 3:
            self.force_exit = True

    def request_shutdown(self, grace_s: float) -> None:
        """Thread- and signal-safe: the bridge is told on the event loop's thread."""
        self.should_exit = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self.bridge.begin_shutdown, grace_s)
