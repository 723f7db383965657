"""Run an ASGI app (the Quicksilver server) with uvicorn on a background thread, on a free local port, so the
agent and ``ask`` can talk to "the same server" through the stock OpenAI client without a separate process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_in_thread(app, startup_timeout: float = 120.0) -> Iterator[str]:
    """Yields the base URL (``http://127.0.0.1:PORT/v1``); shuts the server down on exit."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="quicksilver-local-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the local server failed to start")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the local server did not start within {startup_timeout:g} s")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
