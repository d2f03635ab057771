"""Where a process's Prometheus ``/metrics`` listens: by default the host its own listen address
names (``host_of``), so a process listening on loopback does not publish its metrics on every
interface; ``serve_metrics`` binds it, refusing a host or port that cannot be bound."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

from coordinator.config import ConfigError


def host_of(listen: str) -> str:
    """The host of a ``HOST:PORT`` listen address as a socket binds it: brackets of an IPv6
    literal dropped, and an empty host (``:8080``) is every interface, ``0.0.0.0``, as
    ``worker.http_api.serving.bind_http`` binds it."""
    host = listen.rpartition(":")[0].strip("[]")
    return host or "0.0.0.0"


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve ``registry`` on ``/metrics`` at ``host:port`` (a daemon thread); returns the bound
    port (0 picks a free one). A host that does not resolve or is not this machine's, or a port
    taken, raises ConfigError naming ``--metrics-host``/``--metrics-port``: nothing is served."""
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:  # socket.gaierror too: a name that does not resolve
        shown = f"[{host}]" if ":" in host else host
        raise ConfigError(f"cannot serve /metrics on {shown}:{port} (--metrics-host, "
                          f"--metrics-port): {exc.strerror or exc}") from None
    return int(server.server_port)
