"""A ``kvcoord`` command refusing bad settings as every server does: exit 2 and one line on
stderr, ``kvcoord COMMAND: ...``, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvcoord import child_process

KVCOORD = str(Path(sys.executable).parent / "kvcoord")


def assert_refused_in_one_line(command: str, flags: Sequence[str], says: str,
                               env: Mapping[str, str] | None = None) -> None:
    """``kvcoord COMMAND FLAGS`` (in ``env``, else this one) exits 2 with one line naming
    the command and holding ``says``."""
    result = child_process.run([KVCOORD, command, *flags], capture_output=True, text=True,
                               timeout=30, stdin=subprocess.DEVNULL, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"kvcoord {command}: ") and says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
