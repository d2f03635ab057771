"""The endpoint picker's side of Envoy's external-processing protocol
(``envoy.service.ext_proc.v3``, stubs from PyPI ``xds-protos``), as the Gateway API Inference
Extension's endpoint picker protocol uses it: what a ``ProcessingRequest`` says (headers,
body, the subset hint, the address that served) and the ``ProcessingResponse`` answers (the
chosen endpoint in a header and in ``envoy.lb`` dynamic metadata, an immediate refusal, a
plain continue)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpHeaders,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""Where the request goes (``host:port``; a comma-separated fallback list is allowed): the
header an ``ORIGINAL_DST`` cluster reads, and the key under ``envoy.lb`` metadata."""
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_HEADER = "x-gateway-destination-endpoint-subset"
"""The endpoints the gateway allows (a list under ``envoy.lb.subset_hint`` metadata)."""
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
EXT_PROC_ATTRIBUTES = "envoy.filters.http.ext_proc"
"""Where Envoy puts the attributes it was asked to send (``upstream.address``...)."""
UPSTREAM_ADDRESS = "upstream.address"
BUFFERED = ProcessingMode.BUFFERED
FULL_DUPLEX_STREAMED = ProcessingMode.FULL_DUPLEX_STREAMED


def header_map(headers: HttpHeaders) -> dict[str, str]:
    """The headers by lower-case name (Envoy sends ``raw_value``; older ones ``value``)."""
    return {h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
            for h in headers.headers.headers}


def subset_hint(request: ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the gateway's subset hint allows, or None when it gives none."""
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_HEADER not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_HEADER]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values)
    return frozenset(e.strip() for e in value.string_value.split(",") if e.strip())


def served_address(request: ProcessingRequest) -> str | None:
    """The upstream address that served the request, when Envoy sends it
    (``response_attributes: [upstream.address]``)."""
    attributes = request.attributes.get(EXT_PROC_ATTRIBUTES)
    if attributes is None or UPSTREAM_ADDRESS not in attributes.fields:
        return None
    return attributes.fields[UPSTREAM_ADDRESS].string_value or None


def _header(name: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=name, raw_value=value.encode()),
                             append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _destination_metadata(endpoints: Sequence[str]) -> Struct:
    metadata = Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: ",".join(endpoints)}})
    return metadata


def _mutation(endpoints: Sequence[str], extra: Mapping[str, str]) -> CommonResponse:
    headers = [_header(DESTINATION_HEADER, ",".join(endpoints))]
    headers += [_header(name, value) for name, value in extra.items()]
    return CommonResponse(header_mutation=HeaderMutation(set_headers=headers),
                          clear_route_cache=True)


def picked_after_headers(endpoints: Sequence[str],
                         extra: Mapping[str, str]) -> ProcessingResponse:
    """The pick of a request without a body, as the answer to its headers."""
    return ProcessingResponse(request_headers=HeadersResponse(
        response=_mutation(endpoints, extra)),
        dynamic_metadata=_destination_metadata(endpoints))


def picked_after_buffered_body(endpoints: Sequence[str],
                               extra: Mapping[str, str]) -> ProcessingResponse:
    """The pick, as the answer to a buffered body (the request's headers are still held, so
    the mutation applies to them)."""
    return ProcessingResponse(request_body=BodyResponse(response=_mutation(endpoints, extra)),
                              dynamic_metadata=_destination_metadata(endpoints))


def picked_full_duplex(endpoints: Sequence[str], extra: Mapping[str, str],
                       body: bytes) -> list[ProcessingResponse]:
    """The pick in full-duplex streaming: the held headers' answer, then the body, whole and
    unchanged, as the one streamed chunk."""
    return [
        ProcessingResponse(request_headers=HeadersResponse(response=_mutation(endpoints, extra)),
                           dynamic_metadata=_destination_metadata(endpoints)),
        ProcessingResponse(request_body=BodyResponse(response=CommonResponse(
            body_mutation=BodyMutation(streamed_response=StreamedBodyResponse(
                body=body, end_of_stream=True))))),
    ]


def continued(kind: str) -> ProcessingResponse:
    """Go on unchanged, as the answer to a message of ``kind`` (``request_headers``,
    ``response_headers``, ``request_body``, ...)."""
    if kind.endswith("headers"):
        return ProcessingResponse(**{kind: HeadersResponse()})
    if kind.endswith("body"):
        return ProcessingResponse(**{kind: BodyResponse()})
    if kind.endswith("trailers"):
        return ProcessingResponse(**{kind: TrailersResponse()})
    raise ValueError(f"no plain answer for a {kind!r} message")


def answered_headers(extra: Mapping[str, str]) -> ProcessingResponse:
    """The engine's answer headers let through, with ``extra`` set on them (which engine,
    which route: as ``kvcoord gateway`` answers)."""
    return ProcessingResponse(response_headers=HeadersResponse(response=CommonResponse(
        header_mutation=HeaderMutation(set_headers=[
            _header(name, value) for name, value in extra.items()]))))


def refused(status: int, body: Mapping[str, object],
            headers: Iterable[tuple[str, str]] = ()) -> ProcessingResponse:
    """An immediate answer to the client, in place of the engine's: ``status`` with ``body``
    as JSON (the OpenAI error shape) and ``headers`` (``Retry-After``...)."""
    mutation = HeaderMutation(set_headers=[
        _header("content-type", "application/json"),
        *(_header(name, value) for name, value in headers)])
    return ProcessingResponse(immediate_response=ImmediateResponse(
        status=HttpStatus(code=status), headers=mutation, body=json.dumps(body).encode(),
        details=f"kvcoord_epp_{status}"))
