"""The replication events' wire form: every kind round-trips exactly; anything else is a
MalformedEvent (skipped by the tailer), never a crash or a wrong event."""

from __future__ import annotations

import base64
import json

import pytest

from coordinator.index import Tier
from coordinator.replica_events import (
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
    SnapshotDone,
    SnapshotWanted,
    State,
    decode,
    encode,
)
from coordinator.routing import WorkerLoad
from coordinator.sessions import PageEventIn

KEYS = [bytes([i]) * 16 for i in range(6)]

EVENTS: list[ReplicaEvent] = [
    Registered("w1", 3, "10.0.0.1:7000", "llama", 2, False, 4096),
    Attached("w1", 3, 17),
    Detached("w1", 3),
    Pages("w1", 3, 17, (PageEventIn("stored", tuple(KEYS[:3])),
                        PageEventIn("removed", (KEYS[3],), Tier.CPU),
                        PageEventIn("cleared", ()))),
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
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_round_trips(event: ReplicaEvent) -> None:
    fields = encode("c1", 1_700_000_000_123, event)
    assert all(isinstance(v, str) for v in fields.values())
    envelope = decode(fields)
    assert (envelope.origin, envelope.published_ms, envelope.event) == (
        "c1", 1_700_000_000_123, event)


def _pages_fields(body: dict[str, object], blob: bytes) -> dict[str, str]:
    return {"o": "c1", "t": "1", "k": "pages", "j": json.dumps(body),
            "p": base64.b64encode(blob).decode()}


@pytest.mark.parametrize(("fields", "why"), [
    ({}, "no fields"),
    ({"o": "c1", "t": "1", "k": "teleported", "j": "{}"}, "unknown kind"),
    ({"o": "c1", "t": "soon", "k": "want", "j": '{"worker_id": ""}'}, "bad timestamp"),
    ({"o": "c1", "t": "1", "k": "want", "j": "{not json"}, "bad JSON"),
    ({"o": "c1", "t": "1", "k": "attached",
      "j": '{"worker_id": "w", "incarnation": true, "next_seq": 1}'}, "bool for an int"),
    ({"o": "c1", "t": "1", "k": "attached", "j": '{"worker_id": "w"}'}, "missing fields"),
    ({"o": "c1", "t": "1", "k": "want", "j": '{"worker_id": "", "extra": 1}'}, "extra field"),
    ({"o": "c1", "t": "1", "k": "want", "j": '{"worker_id": ""}', "p": "AAAA"},
     "keys where none belong"),
    (_pages_fields({"w": "w", "i": 1, "s": 1, "e": [["stored", "gpu", 2]]}, KEYS[0]),
     "fewer keys than counted"),
    (_pages_fields({"w": "w", "i": 1, "s": 1, "e": [["stored", "gpu", 1]]}, KEYS[0] * 2),
     "more keys than counted"),
    (_pages_fields({"w": "w", "i": 1, "s": 1, "e": [["stored", "gpu", 1]]}, b"x" * 15),
     "a ragged key blob"),
    (_pages_fields({"w": "w", "i": 1, "s": 1, "e": [["melted", "gpu", 1]]}, KEYS[0]),
     "unknown page event"),
    (_pages_fields({"w": "w", "i": 1, "s": 1, "e": [["stored", "tape", 1]]}, KEYS[0]),
     "unknown tier"),
    ({"o": "c1", "t": "1", "k": "pages", "j": '{"w": "w", "i": 1, "s": 1, "e": []}',
      "p": "!!!"}, "not base64"),
    ({"o": "c1", "t": "1", "k": "state",
      "j": '{"w": "w", "i": 1, "v": 0, "l": [1, 2], "c": 0, "d": false, "f": false}'},
     "short load"),
    ({"o": "c1", "t": "1", "k": "state",
      "j": '{"w": "w", "i": 1, "v": 0, "l": [-1, 0, 0, 0], "c": 0, "d": false, "f": false}'},
     "negative load"),
])
def test_malformed_entries_are_refused_with_a_reason(fields: dict[str, str], why: str) -> None:
    with pytest.raises(MalformedEvent, match="unreadable replication event"):
        decode(fields)
