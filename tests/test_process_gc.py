"""A serving process settles its garbage collector once started (``coordinator.process_gc``):
what starting built is frozen out of every later collection, and young collections come about
once per ``YOUNG_THRESHOLD`` net allocations. Run in a fresh interpreter, so the test process's
own collector is left as it was."""

from __future__ import annotations

import json
import subprocess
import sys

from coordinator.process_gc import YOUNG_THRESHOLD
from kvcoord import child_process

PROBE = """
import gc, json
from coordinator.process_gc import settle_after_start
before = gc.get_threshold()
kept = [[i] for i in range(10_000)]  # built at start, alive for good
settle_after_start()
print(json.dumps({"before": before, "after": gc.get_threshold(),
                  "frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())}))
"""


def test_settling_freezes_what_start_built_and_raises_the_young_threshold() -> None:
    done = child_process.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          check=True, stdin=subprocess.DEVNULL)
    seen = json.loads(done.stdout)
    assert seen["before"][0] == 700  # CPython's default
    assert seen["after"] == [YOUNG_THRESHOLD, seen["before"][1], seen["before"][2]]
    assert seen["frozen"] >= 10_000  # the kept lists went to the permanent generation
    assert seen["tracked"] < 1_000  # so no collection walks them again
