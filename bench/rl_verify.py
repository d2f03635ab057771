"""Which samples of ``kvcoord bench rl`` were made by the weights they are attributed to.

Every answered sample is regenerated (``rl_samples.regenerate``) on a fresh engine started on
its version's checkpoint (equal samples once: a GRPO group's are mostly equal): greedy decoding
on float32 weights reproduces it token for token, or the sample is **wrong**: generated (even
partly) under other weights, or attributed to the wrong version. A wrong sample attributed to
``v`` is also regenerated under ``v + 1``:

- **made by the next version**: equal to ``v + 1``'s, token for token: made wholly by the new
  weights and attributed to the old ones (sent before the trainer's counter moved, run after
  the engine reloaded);
- **mixed**: equal to neither: made partly by the old weights (its request was running when
  the weights changed, or it reused KV the old weights computed).

Only samples answered after the update to ``v + 1`` began can be either; the check under
``v + 1`` is made for those alone. A sample attributed to a version with no checkpoint (no
version header, say) is wrong without a check.

The fresh engines start two at a time (one per core), in version order: ``(0, 1)``,
``(2, 3)``, ...; every arm's samples are checked on the same engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.rl_fleet import MODEL
from bench.rl_load import Sent
from bench.rl_report import by_version
from bench.rl_samples import Sample, regenerate

ENGINES_AT_ONCE = 2  # one per core of the machine this bench was sized on


@dataclass(frozen=True, slots=True)
class Verdict:
    """One arm's regenerated samples: ``wrong`` those not reproduced under their own version,
    of which ``made_by_next`` are reproduced under the next one (the rest are mixed)."""

    checked: int
    distinct: int  # distinct (prompt, length, tokens) among them: what was regenerated
    wrong: tuple[Sent, ...]
    made_by_next: tuple[Sent, ...]

    def summary(self) -> dict[str, Any]:
        return {"checked": self.checked, "distinct_regenerated": self.distinct,
                "wrong": len(self.wrong),
                "made_by_next_version": len(self.made_by_next),
                "mixed": len(self.wrong) - len(self.made_by_next),
                "wrong_by_version": by_version(s.sample for s in self.wrong if s.sample)}


@dataclass(frozen=True, slots=True)
class _Check:
    arm: str
    sent: Sent
    key: Sample  # what a fresh engine of key.version must reproduce: prompt, length, tokens
    own: bool  # key.version is the sample's own version (else the next one)


def _key(sample: Sample, version: int) -> Sample:
    """The sample as far as regenerating it goes: equal samples (a GRPO group's, mostly) are
    regenerated once, since a fresh engine answers one request the same every time."""
    return replace(sample, version=version, worker="", cached_tokens=0)


def verify(python: Path, checkpoints: Mapping[int, Path], arms: Mapping[str, Sequence[Sent]],
           update_began: Mapping[str, Mapping[int, float]], log_dir: Path) -> dict[str, Verdict]:
    """Each arm's verdict. ``update_began[arm][v]``: when that arm's update to ``v`` began
    (monotonic, as the ``Sent`` times)."""
    checks: list[_Check] = []
    unknown: dict[str, list[Sent]] = {arm: [] for arm in arms}  # no checkpoint: not checked
    for arm, sent in arms.items():
        for s in sent:
            if s.sample is None:
                continue
            if s.sample.version not in checkpoints:
                unknown[arm].append(s)
                continue
            checks.append(_Check(arm, s, _key(s.sample, s.sample.version), own=True))
            following = s.sample.version + 1
            began = update_began[arm].get(following)
            if following in checkpoints and began is not None and s.answered_at >= began:
                checks.append(_Check(arm, s, _key(s.sample, following), own=False))
    keys = {c.key for c in checks}
    failed: set[Sample] = set()  # the keys a fresh engine did not reproduce
    versions = sorted({k.version for k in keys})
    for i in range(0, len(versions), ENGINES_AT_ONCE):
        chunk = versions[i:i + ENGINES_AT_ONCE]
        batch = [k for k in keys if k.version in chunk]
        failed |= set(regenerate(python, {v: checkpoints[v] for v in chunk}, batch, log_dir,
                                 MODEL))
    verdicts = {}
    for arm in arms:
        own = [c for c in checks if c.arm == arm and c.own]
        wrong = [c.sent for c in own if c.key in failed] + unknown[arm]
        wrong_ids = {s.request_id for s in wrong}
        by_next = [c.sent for c in checks if c.arm == arm and not c.own
                   and c.sent.request_id in wrong_ids and c.key not in failed]
        verdicts[arm] = Verdict(len(own) + len(unknown[arm]), len({c.key for c in own}),
                                tuple(wrong), tuple(by_next))
    return verdicts
