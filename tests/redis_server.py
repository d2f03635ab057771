"""A real ``redis-server`` for tests: its own loopback port, temp dir and persistence settings.

    with RedisServer(appendonly=True, appendfsync="always") as server:
        url = server.url
        server.restart(hard=True)   # SIGKILL, then start again on the same port and data dir

Never touches a Redis the machine already runs: the port is a fresh free one.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from kvcoord import child_process

BINARY = "redis-server"


def redis_server_available() -> bool:
    return shutil.which(BINARY) is not None


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process. ``appendonly``/``appendfsync`` set AOF persistence; RDB
    snapshots are off, so without AOF a restart starts empty."""

    def __init__(
        self,
        *,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        startup_timeout_s: float = 10.0,
    ) -> None:
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self.dir = Path(tempfile.mkdtemp(prefix="kvcoord-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start and wait until it answers PING (after loading its AOF, if any). The first start
        picks a free port, retrying if another process grabs it first; later starts reuse it."""
        if self.running:
            raise RuntimeError("redis-server already running")
        if self.port:
            self._launch(self.port)
            return
        for attempt in range(3):
            try:
                self._launch(free_port())
                return
            except RuntimeError:
                if attempt == 2:
                    raise

    def _launch(self, port: int) -> None:
        args = [
            BINARY,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--logfile", "redis.log",
            "--daemonize", "no",
        ]  # fmt: skip
        self._proc = child_process.start(args, cwd=self.dir, stdout=subprocess.DEVNULL)
        self.port = port
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break
                try:
                    # Ask for the pid, so a stranger that grabbed the port cannot pass as ours.
                    if client.info("server")["process_id"] == self._proc.pid:
                        return
                except RedisConnectionError:  # not listening yet, or still loading (LOADING)
                    time.sleep(0.01)
        finally:
            client.close()
        self.stop(hard=True)
        raise RuntimeError(f"redis-server on port {port} did not start:\n{self.log_tail()}")

    def stop(self, *, hard: bool = False) -> None:
        """SIGTERM (a clean shutdown) or, with ``hard``, SIGKILL (a crash); waits for exit."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def restart(self, *, hard: bool = False) -> None:
        """Stop (crash with ``hard``) and start again on the same port and data directory."""
        self.stop(hard=hard)
        self.start()

    def log_tail(self, lines: int = 20) -> str:
        log = self.dir / "redis.log"
        return "\n".join(log.read_text().splitlines()[-lines:]) if log.exists() else "(no log)"

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
