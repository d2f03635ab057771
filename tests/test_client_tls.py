"""Client-side TLS and bearer tokens: ClientTls and token-file validation, mutual TLS against real
grpc servers (what the server learns of the client from ``context.auth_context()``), and the
SDK clients and the worker agent presenting their certificate and token on every call."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.client import AsyncCoordinatorClient, CoordinatorClient
from coordinator.client.channels import ClientTls, open_aio_channel, open_channel, read_token_file
from tests.tls_certs import Pki, make_pki
from worker.agent import CoordinatorAgent
from worker.client import AsyncWorkerClient, WorkerClient
from worker.config import WorkerConfig
from worker.metrics import WorkerMetrics
from worker.runtime.engine import ModelConfig
from worker.runtime.runtime import WorkerRuntime
from worker.serving.gate import GenerationGate
from worker.sync.sync_protocol import SyncCounters


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), ("alice", "worker-0"))


def read(path: str) -> bytes:
    return Path(path).read_bytes()


def server_credentials(pki: Pki, *, require_client_auth: bool = True) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(read(pki.server.key), read(pki.server.cert))], root_certificates=read(pki.ca),
        require_client_auth=require_client_auth,
    )


def client_tls(pki: Pki, client: str | None = "alice", **kwargs: Any) -> ClientTls:
    if client is None:
        return ClientTls.from_files(pki.ca, **kwargs)
    files = pki.clients[client]
    return ClientTls.from_files(pki.ca, files.cert, files.key, **kwargs)


# --------------------------------------------------------------------------- validation


def test_a_client_certificate_and_its_key_go_together(pki: Pki) -> None:
    ca, cert, key = read(pki.ca), read(pki.clients["alice"].cert), read(pki.clients["alice"].key)
    with pytest.raises(ValueError, match="both or neither"):
        ClientTls(ca, cert_pem=cert)
    with pytest.raises(ValueError, match="both or neither"):
        ClientTls(ca, key_pem=key)
    with pytest.raises(ValueError, match="both or neither"):
        ClientTls.from_files(pki.ca, cert=pki.clients["alice"].cert)
    assert ClientTls(ca, cert, key).cert_pem == cert
    assert "PRIVATE" not in repr(ClientTls(ca, cert, key))  # keys never reach a log line


def test_input_that_is_not_pem_is_refused(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(ValueError, match="ca_pem is not PEM"):
        ClientTls(b"\x30\x82 a DER blob")
    der = tmp_path / "ca.der"
    der.write_bytes(b"\x30\x82 a DER blob")
    with pytest.raises(ValueError, match=f"CA bundle {der} is not PEM"):
        ClientTls.from_files(str(der))
    with pytest.raises(ValueError, match=f"client key {der} is not PEM"):
        ClientTls.from_files(pki.ca, pki.clients["alice"].cert, str(der))


def test_a_missing_file_is_named(tmp_path: Path, pki: Pki) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(ValueError, match=f"CA bundle {missing}: cannot read it"):
        ClientTls.from_files(str(missing))
    with pytest.raises(ValueError, match=f"client certificate {missing}: cannot read it"):
        ClientTls.from_files(pki.ca, str(missing), pki.clients["alice"].key)
    with pytest.raises(ValueError, match=f"CA bundle {tmp_path}: cannot read it"):
        ClientTls.from_files(str(tmp_path))  # a directory


def test_a_token_file_gives_its_token_without_surrounding_whitespace(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("  abc.DEF-123_=\n\n")
    assert read_token_file(str(path)) == "abc.DEF-123_="


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read it"),
    ("", "is empty"),
    (" \n\t\n", "is empty"),
    ("one two\n", "more than one token"),
    ("one\ntwo\n", "more than one token"),
    ("tab\tinside", "more than one token"),
])
def test_a_bad_token_file_is_refused_naming_the_file(
    tmp_path: Path, content: str | None, message: str,
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as caught:
        read_token_file(str(path))
    assert str(path) in str(caught.value)
    assert "two" not in str(caught.value)  # the content is never echoed


# --------------------------------------------------------------------------- mutual TLS


class RecordingHealth(health_pb2_grpc.HealthServicer):
    """The health service, remembering what each call's context said about the caller."""

    def __init__(self) -> None:
        self.auth: list[dict[str, list[bytes]]] = []
        self.identity_keys: list[str | None] = []

    async def Check(self, request: Any, context: Any) -> health_pb2.HealthCheckResponse:
        self.auth.append(dict(context.auth_context()))
        self.identity_keys.append(context.peer_identity_key())
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@contextlib.asynccontextmanager
async def health_server(
    credentials: grpc.ServerCredentials | None,
) -> AsyncIterator[tuple[int, RecordingHealth]]:
    server = grpc.aio.server()
    servicer = RecordingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        yield port, servicer
    finally:
        await server.stop(0)


async def check(target: str, tls: ClientTls | None) -> grpc.StatusCode:
    async with open_aio_channel(target, [], tls) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                             timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_mutual_tls_succeeds_and_the_server_sees_the_clients_common_name(pki: Pki) -> None:
    async with health_server(server_credentials(pki)) as (port, servicer):
        assert await check(f"127.0.0.1:{port}", client_tls(pki)) == grpc.StatusCode.OK
    (auth,) = servicer.auth
    assert auth["transport_security_type"] == [b"ssl"]
    assert auth["security_level"] == [b"TSI_PRIVACY_AND_INTEGRITY"]
    assert auth["x509_common_name"] == [b"alice"]
    assert auth["x509_subject"] == [b"CN=alice,O=kvcoord-tests"]  # RFC 2253: last RDN first
    assert auth["x509_pem_cert"] == [read(pki.clients["alice"].cert)]
    assert "x509_subject_alternative_name" not in auth
    assert servicer.identity_keys == ["x509_common_name"]  # no SAN: the CN is the identity


async def test_without_a_client_certificate_the_handshake_fails(pki: Pki) -> None:
    async with health_server(server_credentials(pki)) as (port, servicer):
        code = await check(f"127.0.0.1:{port}", client_tls(pki, client=None))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert servicer.auth == []


async def test_a_client_certificate_from_another_ca_is_refused(
    pki: Pki, tmp_path: Path,
) -> None:
    stranger = make_pki(tmp_path, ("alice",)).clients["alice"]  # same name, another CA
    tls = ClientTls.from_files(pki.ca, stranger.cert, stranger.key)
    async with health_server(server_credentials(pki)) as (port, servicer):
        assert await check(f"127.0.0.1:{port}", tls) == grpc.StatusCode.UNAVAILABLE
    assert servicer.auth == []


async def test_the_server_certificate_is_checked_against_the_ca_and_the_name(pki: Pki) -> None:
    async with health_server(server_credentials(pki)) as (port, _):
        target = f"127.0.0.1:{port}"
        untrusted = ClientTls.from_files(pki.other_ca, pki.clients["alice"].cert,
                                         pki.clients["alice"].key)
        assert await check(target, untrusted) == grpc.StatusCode.UNAVAILABLE
        assert await check(target, client_tls(pki, server_name="localhost")) \
            == grpc.StatusCode.OK
        assert await check(target, client_tls(pki, server_name="elsewhere.example")) \
            == grpc.StatusCode.UNAVAILABLE
        assert await check(f"localhost:{port}", client_tls(pki)) == grpc.StatusCode.OK
        assert await check(target, None) == grpc.StatusCode.UNAVAILABLE  # plaintext to TLS


async def test_a_certificate_with_sans_is_identified_by_them(tmp_path: Path) -> None:
    sans = {"w1": ["worker-1.kvcoord", "spiffe://kvcoord/worker/1"]}
    pki = make_pki(tmp_path, ("w1",), client_sans=sans)
    async with health_server(server_credentials(pki)) as (port, servicer):
        assert await check(f"127.0.0.1:{port}", client_tls(pki, "w1")) == grpc.StatusCode.OK
    (auth,) = servicer.auth
    assert auth["x509_common_name"] == [b"w1"]
    assert auth["x509_subject_alternative_name"] == [b"worker-1.kvcoord",
                                                     b"spiffe://kvcoord/worker/1"]
    assert auth["peer_dns"] == [b"worker-1.kvcoord"]
    assert auth["peer_uri"] == auth["peer_spiffe_id"] == [b"spiffe://kvcoord/worker/1"]
    assert servicer.identity_keys == ["x509_subject_alternative_name"]


async def test_a_server_not_requiring_client_certificates_never_sees_one(pki: Pki) -> None:
    # grpc python has no "request but do not require": require_client_auth=False does not even
    # ask, so a client certificate is neither sent nor visible.
    credentials = server_credentials(pki, require_client_auth=False)
    async with health_server(credentials) as (port, servicer):
        assert await check(f"127.0.0.1:{port}", client_tls(pki)) == grpc.StatusCode.OK
        assert await check(f"127.0.0.1:{port}", client_tls(pki, None)) == grpc.StatusCode.OK
    for auth in servicer.auth:
        assert auth["transport_security_type"] == [b"ssl"]
        assert not [key for key in auth if key.startswith("x509_")]
    assert servicer.identity_keys == [None, None]


async def test_a_plaintext_call_has_no_peer_identity() -> None:
    async with health_server(None) as (port, servicer):
        assert await check(f"127.0.0.1:{port}", None) == grpc.StatusCode.OK
    assert servicer.auth == [{"transport_security_type": [b"insecure"],
                              "security_level": [b"TSI_SECURITY_NONE"]}]
    assert servicer.identity_keys == [None]


# --------------------------------------------------------------------------- who says what


@dataclass(frozen=True, slots=True)
class Seen:
    method: str
    authorization: tuple[str, ...]  # every authorization header of the call
    common_name: bytes | None


class Recorder(grpc.GenericRpcHandler):
    """Answers every method of every service (an empty message: any proto's defaults) and
    remembers who called it. A stream call is answered with no message, then OK."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.changed = threading.Condition()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method.rsplit("/", 1)[-1]

        def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
            self._record(method, context)
            return b""

        def server_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            self._record(method, context)
            return iter(())

        def bidi(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
            self._record(method, context)
            next(requests, None)  # the caller's first message (a hello) arrives, then OK
            return iter(())

        if method == "Sync":
            return grpc.stream_stream_rpc_method_handler(bidi)
        if method == "WatchPolicy":
            return grpc.unary_stream_rpc_method_handler(server_stream)
        return grpc.unary_unary_rpc_method_handler(unary)

    def _record(self, method: str, context: grpc.ServicerContext) -> None:
        tokens = tuple(v for k, v in context.invocation_metadata() if k == "authorization")
        names = context.auth_context().get("x509_common_name")
        with self.changed:
            self.seen.append(Seen(method, tokens, names[0] if names else None))
            self.changed.notify_all()

    def wait_for(self, method: str, count: int, timeout: float = 10.0) -> bool:
        """Block until ``method`` was called ``count`` times (False on timeout)."""
        with self.changed:
            return self.changed.wait_for(
                lambda: [s.method for s in self.seen].count(method) >= count, timeout)


@contextlib.contextmanager
def recording_server(pki: Pki | None) -> Iterator[tuple[str, Recorder]]:
    """A thread-pool server (blocking clients may call it from the test's thread)."""
    recorder = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[recorder])
    if pki is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", server_credentials(pki))
    server.start()
    try:
        yield f"127.0.0.1:{port}", recorder
    finally:
        server.stop(0).wait()


def test_blocking_clients_present_their_certificate_and_token(pki: Pki) -> None:
    with recording_server(pki) as (target, recorder):
        with CoordinatorClient(target, "tok-c", tls=client_tls(pki)) as coordinator:
            coordinator.stats()
        with WorkerClient(target, token="tok-w", tls=client_tls(pki, "worker-0")) as worker:
            worker.stats()
    assert recorder.seen == [Seen("GetStats", ("Bearer tok-c",), b"alice"),
                             Seen("GetStats", ("Bearer tok-w",), b"worker-0")]


async def test_async_clients_present_their_certificate_and_token(pki: Pki) -> None:
    with recording_server(pki) as (target, recorder):
        async with AsyncCoordinatorClient(target, "tok-c", tls=client_tls(pki)) as coordinator:
            await coordinator.stats()
            assert [p async for p in coordinator.watch_policy()] == []
        async with AsyncWorkerClient(target, token="tok-w",
                                     tls=client_tls(pki, "worker-0")) as worker:
            await worker.stats()
    assert recorder.seen == [Seen("GetStats", ("Bearer tok-c",), b"alice"),
                             Seen("WatchPolicy", ("Bearer tok-c",), b"alice"),
                             Seen("GetStats", ("Bearer tok-w",), b"worker-0")]


def test_without_a_token_no_authorization_is_sent() -> None:
    with recording_server(None) as (target, recorder):
        with WorkerClient(target) as worker:
            worker.stats()
        with open_channel(target, [], None) as channel:
            channel.unary_unary("/kvcoord.Anything/Ping")(b"", timeout=5)
    assert recorder.seen == [Seen("GetStats", (), None), Seen("Ping", (), None)]


async def test_a_channel_with_a_token_sends_it_once_on_every_kind_of_call() -> None:
    async def one() -> AsyncIterator[bytes]:
        yield b""

    with recording_server(None) as (target, recorder):
        async with open_aio_channel(target, [], None, token="tok") as channel:
            # The caller's own metadata is kept beside the token.
            await channel.unary_unary("/s.S/Unary")(b"", timeout=5,
                                                    metadata=(("x-trace", "1"),))
            assert [m async for m in channel.unary_stream("/s.S/WatchPolicy")(b"")] == []
            sync = channel.stream_stream("/s.S/Sync")()
            await sync.write(b"hello")
            assert await sync.read() is grpc.aio.EOF
    assert recorder.seen == [Seen(m, ("Bearer tok",), None)
                             for m in ("Unary", "WatchPolicy", "Sync")]


async def test_the_worker_agent_registers_and_syncs_with_its_token_and_certificate(
    pki: Pki, tmp_path: Path,
) -> None:
    token_file = tmp_path / "worker-token"
    token_file.write_text("tok-worker\n")
    worker = pki.clients["worker-0"]
    with recording_server(pki) as (target, recorder):
        config = WorkerConfig(coordinator=target, pages=8, device="cpu",
                              token_file=str(token_file), tls_ca=pki.ca, tls_cert=worker.cert,
                              tls_key=worker.key, backoff_initial_ms=10, backoff_max_ms=50)
        runtime = WorkerRuntime(model=ModelConfig(max_context=64), pages=8, page_size=16,
                                hash_config=config.hash_config())
        agent = CoordinatorAgent(config, runtime, GenerationGate(), worker_id="w0",
                                 address="127.0.0.1:1", metrics=WorkerMetrics(),
                                 counters=SyncCounters())
        agent.start()
        try:
            # The recorder ends each Sync after the hello: the agent registers and syncs again.
            assert await asyncio.to_thread(recorder.wait_for, "Sync", 2), recorder.seen
        finally:
            await agent.stop(deregister=False)
    assert {s.method for s in recorder.seen} == {"Register", "Sync"}
    assert {(s.authorization, s.common_name) for s in recorder.seen} == {
        (("Bearer tok-worker",), b"worker-0")}

