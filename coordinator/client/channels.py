"""Channels and credentials shared by every kvcoord client (SDK, worker agent, bridge): message
size options, TLS (``ClientTls``), bearer tokens read from files and sent as call metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc


def client_channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """``channel_options`` plus what a failover client needs: its own subchannels (grpc shares
    connections between channels to one address, and with them the reconnect backoff a channel
    to a dead coordinator built up: a new client could not reach the restarted one for up to
    two minutes) and a reconnect backoff capped at 1 s."""
    return [
        *channel_options(max_message_bytes),
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Message-size limits shared by servers and clients (grpc answers RESOURCE_EXHAUSTED)."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata of a call made with bearer ``token`` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


# ---------------------------------------------------------------- channels: TLS and tokens

_PEM_MARKER = b"-----BEGIN"


@dataclass(frozen=True, slots=True)
class ClientTls:
    """TLS for a client channel: the CA bundle that verifies the server, and optionally this
    client's certificate chain and key (mutual TLS). ``server_name`` overrides the name the
    server's certificate is checked against (``grpc.ssl_target_name_override``), for a target
    dialled by an address its certificate does not name.

    ValueError for a certificate without its key (or the reverse) or input that is not PEM.
    """

    ca_pem: bytes = field(repr=False)
    cert_pem: bytes | None = field(default=None, repr=False)
    key_pem: bytes | None = field(default=None, repr=False)  # never log a private key
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_pem is None) != (self.key_pem is None):
            raise ValueError("a client certificate needs its key and a key its certificate: "
                             "give both or neither")
        for name in ("ca_pem", "cert_pem", "key_pem"):
            value = getattr(self, name)
            if value is not None and _PEM_MARKER not in value:
                raise ValueError(f"{name} is not PEM (no '-----BEGIN' line)")
        if self.server_name is not None and not self.server_name.strip():
            raise ValueError("server_name must not be blank")

    @classmethod
    def from_files(
        cls, ca: str, cert: str | None = None, key: str | None = None,
        server_name: str | None = None,
    ) -> ClientTls:
        """Read the PEM files; ValueError naming the file when one is missing, unreadable or
        not PEM, or when only one of ``cert`` and ``key`` is given."""
        if (cert is None) != (key is None):
            raise ValueError(f"a client certificate needs its key and a key its certificate: "
                             f"give both or neither (got cert={cert!r}, key={key!r})")
        return cls(
            ca_pem=_read_pem(ca, "CA bundle"),
            cert_pem=None if cert is None else _read_pem(cert, "client certificate"),
            key_pem=None if key is None else _read_pem(key, "client key"),
            server_name=server_name,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials: verify the server with ``ca_pem``, present the certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=self.key_pem,
            certificate_chain=self.cert_pem,
        )

    def options(self) -> list[tuple[str, str]]:
        """Channel options TLS adds (the server name override, when set)."""
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def open_channel(
    target: str, options: Sequence[tuple[str, Any]], tls: ClientTls | None
) -> grpc.Channel:
    """A blocking channel to ``target``: plaintext when ``tls`` is None, else TLS with it."""
    if tls is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, tls.credentials(), options=[*options, *tls.options()])


def open_aio_channel(
    target: str, options: Sequence[tuple[str, Any]], tls: ClientTls | None, *,
    token: str | None = None,
) -> grpc.aio.Channel:
    """``open_channel`` for asyncio. With ``token``, every call on the channel carries it as
    ``authorization: Bearer`` metadata, including calls made through stubs by code that never
    sees the token (the worker agent's rollout reporter): an interceptor adds it, so callers
    must not add it again."""
    interceptors = _bearer_interceptors(token) if token else None
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options),
                                         interceptors=interceptors)
    return grpc.aio.secure_channel(target, tls.credentials(),
                                   options=[*options, *tls.options()],
                                   interceptors=interceptors)


def read_token_file(path: str) -> str:
    """The bearer token in ``path``, surrounding whitespace stripped (re-read on each call, so
    a rotated file is picked up by the next channel). ValueError naming the file when it is
    missing, unreadable, empty, or holds whitespace inside the token (two tokens, a stray
    line), which the server would never accept."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValueError(f"token file {path}: cannot read it ({reason})") from None
    if not token:
        raise ValueError(f"token file {path} is empty")
    if any(c.isspace() for c in token):
        raise ValueError(f"token file {path} holds more than one token (whitespace or a "
                         "newline inside); it must hold exactly one")
    return token  # never echoed: errors name the file, not its content


def _read_pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot read it ({exc.strerror})") from None
    if _PEM_MARKER not in data:
        raise ValueError(f"{what} {path} is not PEM (no '-----BEGIN' line)")
    return data


class _Bearer:
    """Adds ``authorization: Bearer`` to a call's metadata. grpc.aio files each interceptor
    under one call kind only, hence one subclass per kind below."""

    def __init__(self, token: str) -> None:
        self._pair = call_metadata(token)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()),
                                                           *self._pair))


class _BearerUnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _BearerUnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _BearerStreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(details), request_iterator)


class _BearerStreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(details), request_iterator)


def _bearer_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    return [kind(token) for kind in (_BearerUnaryUnary, _BearerUnaryStream, _BearerStreamUnary,
                                     _BearerStreamStream)]
