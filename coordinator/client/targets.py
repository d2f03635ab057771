"""``Targets``: a parsed TARGETS list and the order in which calls try them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class Targets(Sequence[str]):
    """TARGETS: ``host:port``, a comma-separated list, or one gRPC name (``dns:///...``)."""

    def __init__(self, targets: list[str]) -> None:
        self._targets = targets
        # NOTE: shared by concurrent calls without a lock: a race only changes which target a
        # call tries first, and each call still tries every target once (``rotation``).
        self._current = 0

    @classmethod
    def parse(cls, spec: str) -> Targets:
        """Split TARGETS at commas, blanks dropped; ValueError when nothing is left or a part
        is neither ``host:port`` nor a gRPC name (``scheme://...``)."""
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        if not parts:
            raise ValueError("no coordinator target given (expected HOST:PORT[,HOST:PORT...])")
        for part in parts:
            if "://" not in part and ":" not in part:
                raise ValueError(f"coordinator target {part!r} is not HOST:PORT")
        return cls(parts)

    def __getitem__(self, i: Any) -> Any:
        return self._targets[i]

    def __len__(self) -> int:
        return len(self._targets)

    def rotation(self, items: Sequence[T]) -> Iterator[T]:
        """Each item once, starting at the target that last worked. Moves the current target
        as it goes, so the one a caller stops at (it answered) is where the next call starts."""
        start = self._current
        for offset in range(len(items)):
            self._current = (start + offset) % len(items)
            yield items[self._current]

    def failed(self) -> None:
        """The current target failed; the next call starts at the one after it."""
        self._current = (self._current + 1) % len(self._targets)
