"""The rollout log (ARCHITECTURE §0, invariant 4).

Workers report what they generated, under their own identity; ``RolloutLog.append`` checks a
batch whole and appends it to the store's ``rollouts`` stream. Trainers read the stream through
the coordinator from a cursor (``RolloutLog.read``), never from Redis directly. A record's
cursor is its stream entry id, so "strictly after this cursor" resumes a read exactly.

Service level: awaits a ``MetadataStore``; imports neither grpc nor redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection, Mapping, Sequence

import structlog

from coordinator.core.errors import FailedPrecondition, InvalidArgument
from coordinator.core.rollout_records import (
    _COUNTS,
    _MAX_ID_PART,
    MAX_RECORDS_PER_CALL,
    MAX_ROLLOUT_ID_CHARS,
    MAX_TOKENS,
    MAX_VERSION,
    Rollout,
)
from coordinator.store.protocol import MetadataStore, StreamEntry, parse_entry_id

log = structlog.get_logger(__name__)

STREAM = "rollouts"


class RolloutLog:
    """The ``rollouts`` stream of one metadata store, bounded to about ``maxlen`` records
    (exactly on the memory store, whole stream nodes more on Redis; see ``MetadataStore``).
    Holds no state of its own: any number of coordinator replicas may share one store."""

    def __init__(self, store: MetadataStore, *, maxlen: int = 1_000_000) -> None:
        if maxlen <= 0:
            raise ValueError(f"maxlen must be positive, got {maxlen}")
        self._store = store
        self._maxlen = maxlen

    async def append(
        self, worker_id: str, served_versions: Collection[int], records: Sequence[Rollout]
    ) -> int:
        """Append ``records``, reported by ``worker_id``, in order; return how many (all).

        The whole batch is checked before anything is written, and any refusal appends
        nothing. Refused with ``InvalidArgument`` (the message names ``records[i].field``):
        more than ``MAX_RECORDS_PER_CALL`` records, an empty ``worker_id``, an empty or
        over-long ``rollout_id``, a version or token count that is negative or over the wire
        limit, ``cached_tokens > prompt_tokens``. Then with ``FailedPrecondition``: a record of
        another worker ("reports only its own"), or of a version not in ``served_versions``
        (the versions this worker incarnation has served: "was not serving version v").
        ``cursor`` of the given records is ignored.

        A ``StoreUnavailable`` while writing leaves a prefix of the batch appended: delivery is
        at least once, and readers de-duplicate by ``rollout_id``.
        """
        if len(records) > MAX_RECORDS_PER_CALL:
            raise InvalidArgument(
                f"{len(records)} rollout records in one call; at most {MAX_RECORDS_PER_CALL}"
            )
        if not worker_id:
            raise InvalidArgument("worker_id must be non-empty")
        for i, record in enumerate(records):
            _check_record(i, record)
        for i, record in enumerate(records):
            if record.worker_id != worker_id:
                raise FailedPrecondition(
                    f"records[{i}]: worker {worker_id!r} reports only its own rollouts, "
                    f"got worker_id {record.worker_id!r}"
                )
            if record.policy_version not in served_versions:
                raise FailedPrecondition(
                    f"records[{i}]: worker {worker_id!r} was not serving version "
                    f"{record.policy_version}"
                )
        for record in records:
            await self._store.append(STREAM, _to_fields(record), maxlen=self._maxlen)
        return len(records)

    async def read(
        self, since: str | None, *, follow: bool, poll_s: float = 0.1, batch: int = 512
    ) -> AsyncIterator[Rollout]:
        """Records strictly after the cursor ``since`` (None or "" = from the oldest kept),
        oldest first, each with its ``cursor`` set. Without ``follow`` it ends once it has
        caught up with the stream; with ``follow`` it then polls the store every ``poll_s``
        seconds for new records until the consumer stops (cancels or closes it).

        Records trimmed away (``maxlen``) are skipped silently; a stored entry that does not
        decode is logged and skipped. ``InvalidArgument`` for a malformed cursor, raised on
        the first iteration, before anything is read. ``StoreUnavailable`` passes through.
        """
        if poll_s <= 0 or batch <= 0:
            raise ValueError(f"poll_s and batch must be positive, got {poll_s}, {batch}")
        cursor = check_cursor(since)
        while True:
            entries = await self._store.read(STREAM, after=cursor, count=batch)
            for entry in entries:
                cursor = entry.entry_id
                rollout = _from_entry(entry)
                if rollout is not None:
                    yield rollout
            if len(entries) < batch:
                if not follow:
                    return
                await asyncio.sleep(poll_s)


def check_cursor(since: str | None) -> str | None:
    """``since`` as a store cursor: None for None or ""; ``InvalidArgument`` unless it is a
    stream entry id ``"<ms>-<seq>"`` (two decimal u64s)."""
    if not since:
        return None
    try:
        ms, seq = parse_entry_id(since)
    except ValueError:
        raise InvalidArgument(
            f"cursor must be a rollout cursor like '1700000000000-0', got {since[:64]!r}"
        ) from None
    if ms > _MAX_ID_PART or seq > _MAX_ID_PART:
        raise InvalidArgument(f"cursor {since[:64]!r} is out of range")
    return f"{ms}-{seq}"


def _check_record(i: int, record: Rollout) -> None:
    """InvalidArgument naming ``records[i].<field>`` for the first field that is wrong."""
    if not record.rollout_id:
        raise InvalidArgument(f"records[{i}].rollout_id must be non-empty")
    if len(record.rollout_id) > MAX_ROLLOUT_ID_CHARS:
        raise InvalidArgument(
            f"records[{i}].rollout_id is {len(record.rollout_id)} characters; "
            f"at most {MAX_ROLLOUT_ID_CHARS}"
        )
    if not 0 <= record.policy_version <= MAX_VERSION:
        raise InvalidArgument(
            f"records[{i}].policy_version must be 0..{MAX_VERSION}, got {record.policy_version}"
        )
    for name in _COUNTS:
        value: int = getattr(record, name)
        if not 0 <= value <= MAX_TOKENS:
            raise InvalidArgument(f"records[{i}].{name} must be 0..{MAX_TOKENS}, got {value}")
    if record.cached_tokens > record.prompt_tokens:
        raise InvalidArgument(
            f"records[{i}].cached_tokens ({record.cached_tokens}) exceeds prompt_tokens "
            f"({record.prompt_tokens})"
        )


def _to_fields(record: Rollout) -> dict[str, str]:
    return {
        "rollout_id": record.rollout_id,
        "policy_version": str(record.policy_version),
        "worker_id": record.worker_id,
        "prompt_tokens": str(record.prompt_tokens),
        "cached_tokens": str(record.cached_tokens),
        "completion_tokens": str(record.completion_tokens),
    }


def _from_entry(entry: StreamEntry) -> Rollout | None:
    fields: Mapping[str, str] = entry.fields
    try:
        return Rollout(
            rollout_id=fields["rollout_id"],
            policy_version=int(fields["policy_version"]),
            worker_id=fields["worker_id"],
            prompt_tokens=int(fields["prompt_tokens"]),
            cached_tokens=int(fields["cached_tokens"]),
            completion_tokens=int(fields["completion_tokens"]),
            cursor=entry.entry_id,
        )
    except (KeyError, ValueError):
        # Only something other than RolloutLog could have written it; one bad entry must not
        # stop every trainer reading past it.
        log.warning("rollouts.bad_entry", cursor=entry.entry_id, fields=sorted(fields))
        return None
