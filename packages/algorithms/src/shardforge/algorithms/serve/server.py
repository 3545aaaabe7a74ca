"""Run the service over HTTP with uvicorn, in a background thread (tests, notebooks) or in the foreground
(`shardforge serve`)."""

from __future__ import annotations

import threading
import time

from shardforge.algorithms.serve.service import TinkerService

__all__ = ["ServiceServer"]


class ServiceServer:
    """``service`` at ``http://host:port`` (port 0: a free port, read `url` after `start`)."""

    def __init__(self, service: TinkerService, host: str = "127.0.0.1", port: int = 8000) -> None:
        import uvicorn

        from shardforge.algorithms.serve.app import build_app

        self.service = service
        self.host = host
        config = uvicorn.Config(build_app(service), host=host, port=port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL for ``tinker.ServiceClient(base_url=...)``."""
        sockets = [s for server in self.server.servers for s in server.sockets]
        port = sockets[0].getsockname()[1] if sockets else self.server.config.port
        return f"http://{self.host}:{port}"

    def start(self, timeout_s: float = 30.0) -> ServiceServer:
        self._thread = threading.Thread(target=self.server.run, name="shardforge-serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the service did not start on {self.host}:{self.server.config.port} (port in use?)")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.service.close()

    def serve_forever(self) -> None:
        """Run in the calling thread until Ctrl-C."""
        try:
            self.server.run()
        finally:
            self.service.close()
