"""How a call or stream ended, read from a ``grpc.RpcError``: the one place clients decode the
``google.rpc`` status details a kvcoord server sends (``coordinator.rpc.interceptor``).

Every client (the SDK's ``KvcoordError``, the worker's agent and rollout reporter) reads refusals
through ``outcome_of`` and branches on ``code`` and ``reason``, never on ``message``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from coordinator.wire import ERROR_DOMAIN, Reason

_KNOWN = frozenset(r.value for r in Reason)


class Outcome(NamedTuple):
    """A refusal as a client acts on it.

    ``reason``: the ``ErrorInfo`` reason of domain ``kvcoord``; None when the server sent none
    (bad input, a permission, the transport, a server older than this client) or one this client
    does not know. ``retry_after_ms``: the ``RetryInfo`` delay, None when retrying is not
    advised. ``message``: the details text, for logs and people only. ``metadata``: the
    ``ErrorInfo`` metadata (e.g. ``peer_version`` / ``server_version`` for PROTOCOL_VERSION).
    """

    code: grpc.StatusCode
    reason: Reason | None
    retry_after_ms: int | None
    message: str
    metadata: Mapping[str, str]


def outcome_of(error: grpc.RpcError) -> Outcome:
    """The outcome of a failed call: ``error`` as raised by a blocking stub (a ``grpc.Call``) or
    an aio one (``grpc.aio.AioRpcError``), unary or streaming. Never raises: an error without a
    status (a bare ``grpc.RpcError``) reads as UNKNOWN with its ``str``; status details that do
    not parse, or that disagree with the call's code or message (not written by a kvcoord
    server), are ignored."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = (error.details() if hasattr(error, "details") else None) or str(error)
    status = _rich_status(error)
    reason: Reason | None = None
    retry_after_ms: int | None = None
    metadata: dict[str, str] = {}
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == ERROR_DOMAIN and info.reason in _KNOWN:
                reason = Reason(info.reason)
                metadata = dict(info.metadata)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_after_ms = retry.retry_delay.ToMilliseconds()
    return Outcome(code, reason, retry_after_ms, message, metadata)


def _rich_status(error: grpc.RpcError) -> status_pb2.Status | None:
    """The ``google.rpc.Status`` in ``error``'s trailers, or None (none sent, or unreadable)."""
    if not hasattr(error, "trailing_metadata"):
        return None
    try:
        # The blocking from_call also reads an AioRpcError: its accessors are plain methods.
        status: status_pb2.Status | None = rpc_status.from_call(error)
    except (ValueError, DecodeError):  # code or message disagree, or the blob does not parse
        return None
    return status
