"""The replication events' wire form: every kind round-trips exactly; anything else is a
MalformedEvent (skipped by the tailer), never a crash or a wrong event."""

from __future__ import annotations

import base64
import json

import pytest

from coordinator.core.fleet import WorkerLoad
from coordinator.core.index import PagesRemoved, PagesStored, Tier, WorkerCleared
from coordinator.core.routing import RouteReservation
from coordinator.replication.events import (
    Attached,
    Cordoned,
    Detached,
    Dropped,
    MalformedEvent,
    Pages,
    PolicyChanged,
    Registered,
    Replaced,
    ReplicaEvent,
    Routed,
    RoutesEnded,
    SnapshotDone,
    SnapshotWanted,
    State,
    decode,
    encode,
    origin_of,
)

KEYS = [bytes([i]) * 16 for i in range(6)]

EVENTS: list[ReplicaEvent] = [
    Registered("w1", 3, "10.0.0.1:7000", "llama", 2, False, 4096),
    Registered("w2", 1, "10.0.0.2:7000", "llama", 2, True, 64, "http://10.0.0.2:8000"),
    Registered("w3", 1, "10.0.0.3:7000", "llama", 2, False, 64, "", 256),
    Attached("w1", 3, 17),
    Detached("w1", 3),
    Pages("w1", 3, 17, (PagesStored(tuple(KEYS[:3])),
                        PagesStored((KEYS[4],), Tier.CPU),
                        PagesRemoved((KEYS[3],)),
                        WorkerCleared())),
    Replaced("w1", 3, 16, {"gpu": tuple(KEYS[:2]), "disk": (KEYS[5],)}),
    Replaced("w1", 3, 0, {}),
    State("w1", 3, 2, WorkerLoad(running_requests=1, queued_tokens=2, free_pages=3,
                                 total_pages=4), 5, True, False),
    Cordoned("w1", True),
    Dropped("w1", 3, "deregistered"),
    PolicyChanged(abort_running=True),
    SnapshotWanted(""),
    SnapshotWanted("w1"),
    SnapshotDone("c2"),
    Routed(RouteReservation("w1", 3, "ab12-f", tuple(KEYS[2:5]), 4096, 16, False)),
    Routed(RouteReservation("w1", 3, "ab12-10", (), 0, 1, True)),
    Routed(RouteReservation("w1", 3, "ab12-11", tuple(KEYS[:1]), 512, 2, False, 528, 530)),
    RoutesEnded(("ab12-f", "cd34-1")),
    RoutesEnded(()),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_round_trips(event: ReplicaEvent) -> None:
    fields = encode("c1", 1_700_000_000_123, event)
    assert all(isinstance(v, str) for v in fields.values())
    envelope = decode(fields)
    assert (envelope.origin, envelope.published_ms, envelope.event) == (
        "c1", 1_700_000_000_123, event)


def entry(kind: str, body: object, blob: bytes = b"", *, origin: str = "c1",
          published: str = "1") -> dict[str, str]:
    """A stream entry built by hand, part by part (``body`` a JSON string or a value)."""
    text = body if isinstance(body, str) else json.dumps(body)
    return {"e": "\x1f".join((origin, published, kind, text, base64.b64encode(blob).decode()))}


PAGES = {"w": "w", "i": 1, "s": 1}


@pytest.mark.parametrize(("fields", "why"), [
    ({}, "no fields"),
    ({"o": "c1", "t": "1", "k": "want", "j": "{}"}, "an older layout"),
    ({"e": "c1\x1f1\x1fwant"}, "too few parts"),
    (entry("teleported", {}), "unknown kind"),
    (entry("want", {"worker_id": ""}, published="soon"), "bad timestamp"),
    (entry("want", "{not json"), "bad JSON"),
    (entry("attached", {"worker_id": "w", "incarnation": True, "next_seq": 1}),
     "bool for an int"),
    (entry("attached", {"worker_id": "w"}), "missing fields"),
    (entry("want", {"worker_id": "", "extra": 1}), "extra field"),
    (entry("want", {"worker_id": ""}, KEYS[0]), "keys where none belong"),
    (entry("pages", {**PAGES, "e": [["stored", "gpu", 2]]}, KEYS[0]), "fewer keys than counted"),
    (entry("pages", {**PAGES, "e": [["stored", "gpu", 1]]}, KEYS[0] * 2),
     "more keys than counted"),
    (entry("pages", {**PAGES, "e": [["stored", "gpu", 1]]}, b"x" * 15), "a ragged key blob"),
    (entry("pages", {**PAGES, "e": [["melted", "gpu", 1]]}, KEYS[0]), "unknown page event"),
    (entry("pages", {**PAGES, "e": [["stored", "tape", 1]]}, KEYS[0]), "unknown tier"),
    ({"e": "c1\x1f1\x1fpages\x1f" + json.dumps({**PAGES, "e": []}) + "\x1f!!!"},
     "not base64"),
    (entry("state", {"w": "w", "i": 1, "v": 0, "l": [1, 2], "c": 0, "d": False, "f": False}),
     "short load"),
    (entry("state", {"w": "w", "i": 1, "v": 0, "l": [-1, 0, 0, 0], "c": 0, "d": False,
                     "f": False}), "negative load"),
    (entry("routed", {"w": "w", "i": 1, "r": "x", "u": 1, "c": 0, "a": False}), "no copies"),
    (entry("routed", {"w": "w", "i": 1, "r": "x", "u": -1, "c": 1, "a": False}),
     "negative tokens"),
    (entry("routed", {"w": "w", "i": 1, "r": "x", "u": 1, "c": 1}), "missing awaited flag"),
    (entry("routed", {"w": "w", "i": 1, "r": "x", "u": 1, "c": 1, "a": False}, b"x" * 15),
     "a ragged pending-key blob"),
    (entry("ended", {"r": "x"}), "ids not a list"),
    (entry("ended", {"r": [1]}), "an id not a string"),
    (entry("ended", {"r": []}, KEYS[0]), "keys with ended ids"),
])
def test_malformed_entries_are_refused_with_a_reason(fields: dict[str, str], why: str) -> None:
    with pytest.raises(MalformedEvent, match="unreadable replication event"):
        decode(fields)


def test_the_origin_is_read_without_decoding_the_rest() -> None:
    assert origin_of(encode("c7", 1, SnapshotWanted(""))) == "c7"
    assert origin_of({"e": "c7\x1fgarbage"}) == "c7"
    assert origin_of({}) == ""


def test_a_registration_from_a_release_without_http_url_reads_as_none() -> None:
    body = {"worker_id": "w1", "incarnation": 3, "address": "h:1", "model": "m",
            "policy_version": 0, "external": False, "total_pages": 8}
    assert decode(entry("registered", body)).event == Registered("w1", 3, "h:1", "m", 0, False, 8)
    with pytest.raises(MalformedEvent):  # a required field is still required
        decode(entry("registered", {k: v for k, v in body.items() if k != "model"}))


def test_page_events_keep_their_replication_form() -> None:
    # Replicas of the previous release read this form: a kind, a tier (GPU for the kinds that
    # name none) and a key count per event, the keys concatenated in order.
    pages = Pages("w1", 3, 17, (PagesStored(tuple(KEYS[:3])), PagesStored((KEYS[4],), Tier.CPU),
                                PagesRemoved((KEYS[3],)), WorkerCleared()))
    _, _, kind, body, blob = encode("c1", 1, pages)["e"].split("\x1f")
    assert kind == "pages"
    assert json.loads(body)["e"] == [["stored", "gpu", 3], ["stored", "cpu", 1],
                                     ["removed", "gpu", 1], ["cleared", "gpu", 0]]
    assert base64.b64decode(blob) == b"".join([*KEYS[:3], KEYS[4], KEYS[3]])
