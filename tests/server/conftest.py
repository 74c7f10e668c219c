"""One real server for all server tests: the real Engine on the tiny checkpoint, behind uvicorn
on 127.0.0.1 (a free port), started in-process on a thread.

The engine and the server are imported inside the fixtures, not here: pytest loads this file
before the root conftest's pytest_configure re-execs the run with OpenBLAS and the engine's shim
preloaded, and that re-exec does not happen once mlx is imported (`python -m pytest tests/server`
ran on MLX's slow bundled BLAS, without the shim)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from server.bridge import EngineBridge

MAX_CONTEXT = 2048
MAX_QUEUE = 2  # small, so that the 429 test can fill it
DRAFT_CONTEXT = 256  # room-of-one prompts stay short


@dataclass
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT (no /v1)
    bridge: EngineBridge
    model_id: str

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is queued or running (the last job's final step was delivered)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.bridge.idle:
                return
            time.sleep(0.02)
        raise TimeoutError("the engine did not become idle")


@pytest.fixture(scope="session")
def live_server(tiny_checkpoint):
    with serving(tiny_checkpoint, MAX_CONTEXT) as server:
        yield server


@contextlib.contextmanager
def serving(checkpoint, max_context: int) -> Iterator[LiveServer]:
    """The real engine over `checkpoint` behind uvicorn on a free port, until the block ends."""
    import uvicorn

    from engine.config import EngineConfig
    from engine.generate import Engine
    from server.app import create_app
    from server.bridge import EngineBridge

    config = EngineConfig(model_path=str(checkpoint), max_context=max_context)
    bridge = EngineBridge(lambda: Engine(config), max_queue=MAX_QUEUE)
    bridge.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY on connections
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(bridge), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", bridge, bridge.engine.model_id)
    finally:
        server.should_exit = True
        thread.join(10)
        bridge.stop()
        sock.close()


@pytest.fixture(scope="session")
def draft_bridge(tiny_checkpoint, tiny_draft):
    """A second engine thread over the tiny checkpoint, with a draft model: every spec method works."""
    from engine.config import EngineConfig, SpecConfig
    from engine.generate import Engine
    from server.bridge import EngineBridge

    config = EngineConfig(model_path=str(tiny_checkpoint), max_context=DRAFT_CONTEXT,
                          spec=SpecConfig(draft_model=str(tiny_draft)))
    bridge = EngineBridge(lambda: Engine(config), max_queue=MAX_QUEUE)
    bridge.start()
    yield bridge
    bridge.stop()
