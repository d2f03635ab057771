"""structlog configuration: JSON lines when stderr is not a terminal, console when it is."""

from __future__ import annotations

import logging
import sys

import structlog


def warn_development_key() -> None:
    """Log that this process hashes with the public development key (``KVCOORD_HASH_KEY``
    unset): anyone can compute its page keys, so it gives tenants no isolation. The servers and
    the bridge call it where they fall back to that key; the hashing core itself never logs."""
    structlog.get_logger("coordinator.hashing").warning(
        "hashing.dev_key", detail="set KVCOORD_HASH_KEY; the dev key is public")


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    """Configure structlog for the process; call once from an entry point, never from a library.

    ``json=None`` chooses JSON unless stderr is a TTY. Levels below ``level`` are dropped before
    any formatting work.
    """
    use_json = (not sys.stderr.isatty()) if json is None else json
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
