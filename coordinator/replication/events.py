"""What coordinator replicas tell each other through the store's ``events`` stream, and its
wire form (one stream entry per event, string fields only).

Pure core: no grpc, redis or asyncio. The replica that owns a worker's Sync stream publishes
what it learns from the worker (registrations, page batches with their sequence numbers,
resync results, heartbeats); every other replica applies the same changes
(``coordinator.replication.apply``), so all of them answer lookups alike.

An entry has one field, ``e``: five parts joined by US (``\x1f``, which no part can hold):
the origin replica id, the wall-clock milliseconds at publish (for the lag measurement), the
kind, the JSON body, and base64 of the concatenated 16-byte page keys the body counts (empty but
for ``Pages`` and ``Replaced``). One field rather than five: every replica reads every entry,
its own included, and Redis replies cost per field; the origin comes first so a replica skips
its own entries without decoding them (``origin_of``).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from coordinator.core.fleet import WorkerLoad
from coordinator.core.hashing import PageKeys, split_page_keys
from coordinator.core.index import PAGE_EVENT_TYPES, PageEvent, PagesStored, Tier
from coordinator.core.routing import HeldRoute, InFlightRoutes, RouteReservation


@dataclass(frozen=True, slots=True)
class Registered:
    """A worker registered (a new incarnation) through the origin replica."""

    worker_id: str
    incarnation: int
    address: str
    model: str
    policy_version: int
    external: bool
    total_pages: int
    http_url: str = ""  # absent in a release before it: read as none
    host_pages: int = 0  # absent in a release before it: read as none


@dataclass(frozen=True, slots=True)
class Attached:
    """The worker's Sync stream is now on the origin replica; ``next_seq`` as it knows it."""

    worker_id: str
    incarnation: int
    next_seq: int


@dataclass(frozen=True, slots=True)
class Detached:
    """The worker's Sync stream on the origin replica ended (or its lease lapsed there)."""

    worker_id: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class Pages:
    """One applied event batch, with the sequence number the worker gave it."""

    worker_id: str
    incarnation: int
    seq: int
    events: tuple[PageEvent, ...]


@dataclass(frozen=True, slots=True)
class Replaced:
    """The worker's holdings are exactly these as of sequence number ``seq`` (a finished
    resync, or the owner's snapshot for a replica that asked)."""

    worker_id: str
    incarnation: int
    seq: int
    keys_by_tier: Mapping[str, tuple[bytes, ...]] = field(hash=False)


@dataclass(frozen=True, slots=True)
class State:
    """The worker's routing state after a heartbeat or a policy step on its owner."""

    worker_id: str
    incarnation: int
    policy_version: int
    load: WorkerLoad
    completed_routes: int
    draining: bool
    fenced: bool


@dataclass(frozen=True, slots=True)
class Routed:
    """A route the origin chose: count its reservation here too (``Router.take_reservation``)."""

    reservation: RouteReservation


@dataclass(frozen=True, slots=True)
class RoutesEnded:
    """A caller ended these route ids through the origin (``EndRoutes``)."""

    route_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class InFlight:
    """The routes in flight to a worker by the origin's books (its owner), for the replica that
    asked for a snapshot (``requester``; ``Router.restore_inflight``). The others ignore it:
    they counted each route as it was shared."""

    requester: str
    routes: InFlightRoutes


@dataclass(frozen=True, slots=True)
class Cordoned:
    worker_id: str
    cordoned: bool


@dataclass(frozen=True, slots=True)
class Dropped:
    """The worker is gone for good (deregistered, or past the grace period on its owner)."""

    worker_id: str
    incarnation: int
    reason: str


@dataclass(frozen=True, slots=True)
class PolicyChanged:
    """The origin changed the stored policy state: re-read it and relay the commands it calls
    for to your own workers. ``abort_running`` is the Begin's flag (not in the record)."""

    abort_running: bool = False


@dataclass(frozen=True, slots=True)
class SnapshotWanted:
    """The origin needs the owners' view of ``worker_id`` ("" = of every worker they own)."""

    worker_id: str = ""


@dataclass(frozen=True, slots=True)
class SnapshotDone:
    """The origin has published its snapshots for ``requester``'s SnapshotWanted(all)."""

    requester: str


ReplicaEvent = (
    Registered | Attached | Detached | Pages | Replaced | State | Cordoned | Dropped
    | PolicyChanged | SnapshotWanted | SnapshotDone | Routed | RoutesEnded | InFlight
)


@dataclass(frozen=True, slots=True)
class Envelope:
    origin: str
    published_ms: int
    event: ReplicaEvent


class MalformedEvent(ValueError):
    """A stream entry that is not an event of this release (skipped and counted, never fatal)."""


_KINDS: Mapping[str, type[Any]] = MappingProxyType({
    "registered": Registered, "attached": Attached, "detached": Detached, "pages": Pages,
    "replaced": Replaced, "state": State, "cordoned": Cordoned, "dropped": Dropped,
    "policy": PolicyChanged, "want": SnapshotWanted, "done": SnapshotDone, "routed": Routed,
    "ended": RoutesEnded, "inflight": InFlight,
})
_KIND_OF = MappingProxyType({cls: kind for kind, cls in _KINDS.items()})
_LOAD_FIELDS = ("running_requests", "queued_tokens", "free_pages", "total_pages")


def encode(origin: str, published_ms: int, event: ReplicaEvent) -> dict[str, str]:
    """The stream entry for ``event``."""
    body: dict[str, Any]
    blob = b""
    if isinstance(event, Pages):
        body = {"w": event.worker_id, "i": event.incarnation, "s": event.seq,
                "e": [[e.kind, _tier_of(e).value, len(e.keys)] for e in event.events]}
        blob = b"".join(b"".join(e.keys) for e in event.events)
    elif isinstance(event, Replaced):
        body = {"w": event.worker_id, "i": event.incarnation, "s": event.seq,
                "e": [[tier, len(keys)] for tier, keys in event.keys_by_tier.items()]}
        blob = b"".join(b"".join(keys) for keys in event.keys_by_tier.values())
    elif isinstance(event, State):
        load = event.load
        body = {"w": event.worker_id, "i": event.incarnation, "v": event.policy_version,
                "l": [getattr(load, name) for name in _LOAD_FIELDS],
                "c": event.completed_routes, "d": event.draining, "f": event.fenced}
    elif isinstance(event, Routed):
        r = event.reservation
        body = {"w": r.worker_id, "i": r.incarnation, "r": r.route_id, "u": r.uncached_tokens,
                "c": r.copies, "a": r.awaited}
        if r.prefill_tokens is not None:
            body["p"] = r.prefill_tokens
        if r.context_tokens:
            body["x"] = r.context_tokens
        blob = b"".join(r.pending_keys)
    elif isinstance(event, RoutesEnded):
        body = {"r": list(event.route_ids)}
    elif isinstance(event, InFlight):
        routes = event.routes
        body = {"q": event.requester, "w": routes.worker_id, "i": routes.incarnation,
                "h": [list(route) for route in routes.settled_by_heartbeats],
                "a": [[h.route_id, h.uncached_tokens, h.copies, h.context_tokens, h.expires_in_s]
                      for h in routes.awaited]}
    else:
        body = {name: getattr(event, name) for name in event.__slots__}
    parts = (origin, str(published_ms), _KIND_OF[type(event)],
             json.dumps(body, separators=(",", ":")), base64.b64encode(blob).decode("ascii"))
    return {FIELD: SEPARATOR.join(parts)}


FIELD = "e"
SEPARATOR = "\x1f"


def origin_of(fields: Mapping[str, str]) -> str:
    """The publishing replica's id, without decoding the rest ("" when there is none)."""
    return fields.get(FIELD, "").partition(SEPARATOR)[0]


def decode(fields: Mapping[str, str]) -> Envelope:
    """The event in a stream entry; MalformedEvent for anything this release cannot read."""
    try:
        origin, published_ms, kind_name, body_json, blob = fields[FIELD].split(SEPARATOR)
        kind = _KINDS[kind_name]
        body = json.loads(body_json)
        keys = split_page_keys(base64.b64decode(blob, validate=True))
        event = _decode_body(kind, body, keys)
        return Envelope(origin, int(published_ms), event)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise MalformedEvent(f"unreadable replication event {dict(fields)!r}: {exc}") from exc


def _tier_of(event: PageEvent) -> Tier:
    # Only Stored names a tier; the others are written as GPU, as they always were.
    return event.tier if type(event) is PagesStored else Tier.GPU


def _page_event(kind: str, keys: PageKeys, tier: Tier) -> PageEvent:
    """The page event a Pages body names (``kind`` is the variant's ``kind``); KeyError for an
    unknown one (``decode`` reports it as a MalformedEvent)."""
    return _PAGE_EVENT_KINDS[kind].of(keys, tier)


_PAGE_EVENT_KINDS: Mapping[str, type[PageEvent]] = MappingProxyType(
    {variant.kind: variant for variant in PAGE_EVENT_TYPES})


def _take(keys: PageKeys, start: int, count: int) -> PageKeys:
    if count < 0 or start + count > len(keys):
        raise ValueError("key counts do not match the key blob")
    return PageKeys(keys[start:start + count])


def _decode_body(kind: type[Any], body: dict[str, Any], keys: PageKeys) -> ReplicaEvent:
    if kind is Pages:
        events, at = [], 0
        for event_kind, tier, count in body["e"]:
            events.append(_page_event(event_kind, _take(keys, at, count), Tier(tier)))
            at += count
        if at != len(keys):
            raise ValueError("key counts do not match the key blob")
        return Pages(str(body["w"]), int(body["i"]), int(body["s"]), tuple(events))
    if kind is Replaced:
        by_tier, at = {}, 0
        for tier, count in body["e"]:
            by_tier[Tier(tier).value] = _take(keys, at, count)
            at += count
        if at != len(keys):
            raise ValueError("key counts do not match the key blob")
        return Replaced(str(body["w"]), int(body["i"]), int(body["s"]), by_tier)
    if kind is State:
        load = WorkerLoad(**dict(zip(_LOAD_FIELDS, map(int, body["l"]), strict=True)))
        return State(str(body["w"]), int(body["i"]), int(body["v"]), load, int(body["c"]),
                     bool(body["d"]), bool(body["f"]))
    if kind is Routed:
        prefill = body.get("p")  # absent from an older release
        return Routed(RouteReservation(
            str(body["w"]), int(body["i"]), str(body["r"]), tuple(keys), int(body["u"]),
            int(body["c"]), bool(body["a"]), None if prefill is None else int(prefill),
            int(body.get("x", 0)),
        ))
    if keys:
        raise ValueError(f"{kind.__name__} carries no page keys")
    if kind is RoutesEnded:
        ids = body["r"]
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ValueError("RoutesEnded.route_ids must be a list of strings")
        return RoutesEnded(tuple(ids))
    if kind is InFlight:
        held = tuple(HeldRoute(str(i), int(u), int(c), int(x), float(t))
                     for i, u, c, x, t in body["a"])
        settled = tuple((int(u), int(x)) for u, x in body["h"])
        return InFlight(str(body["q"]),
                        InFlightRoutes(str(body["w"]), int(body["i"]), settled, held))
    hints = _hints(kind)
    if not _required(kind) <= set(body) <= set(hints):
        raise ValueError(f"{kind.__name__} fields {sorted(body)}, expected {sorted(hints)}")
    for name, value in body.items():
        # bool is an int in Python: an exact type match keeps True out of an int field.
        if type(value) is not hints[name]:
            raise ValueError(f"{kind.__name__}.{name} must be {hints[name].__name__}")
    event: ReplicaEvent = kind(**body)
    return event


_HINTS: dict[type[Any], dict[str, type[Any]]] = {}
_REQUIRED: dict[type[Any], frozenset[str]] = {}


def _required(kind: type[Any]) -> frozenset[str]:
    """The fields of ``kind`` without a default (a newer field may be absent)."""
    required = _REQUIRED.get(kind)
    if required is None:
        required = _REQUIRED[kind] = frozenset(
            f.name for f in dataclasses.fields(kind)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    return required


def _hints(kind: type[Any]) -> dict[str, type[Any]]:
    hints = _HINTS.get(kind)
    if hints is None:
        hints = _HINTS[kind] = typing.get_type_hints(kind)
    return hints

