"""The docs' "Measured at" lines, generated from the provenance of the result files they quote.

A figure in README.md or docs/*.md taken from ``bench/results/*.json`` names the run it came
from on one generated line, right after a marker naming the files (kvcoord/provenance.py writes
their ``commit`` and ``dirty``; bench suites add ``when`` and ``cpus``)::

    <!-- provenance: bench/results/simulate.json -->
    Measured at commit `7da24ad` on a clean tree (`bench/results/simulate.json`).

The marker is an HTML block, so the generated line always starts a paragraph; prose may follow
it on the next lines. Nobody types that line: ``make docs-provenance`` (``python -m
bench.doc_provenance``) rewrites every marked line from the files, inserting it where a marker
has none, and ``--check`` only reports the stale ones. tests/test_doc_provenance.py fails while a
marked line is stale, and while a doc names a commit of this repository anywhere else without
the test saying why (an earlier run, the commit that changed something), so a typed commit for
the current figures cannot slip in.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from kvcoord import child_process
from kvcoord.provenance import SOURCE_ROOT

MARKER = re.compile(r"^<!-- provenance: (?P<paths>\S+(?: \S+)*) -->$")
GENERATED = "Measured at "
"""Every generated line starts so; the line after a marker that does not is missing one."""
SHORT_SHA = 7
# A run of 7-40 lowercase hex digits standing alone: what a typed commit looks like. Whether it
# is one is for git to say (named_commits), so digests and other projects' commits pass.
HEX_TOKEN = re.compile(r"(?<![0-9A-Za-z_])[0-9a-f]{7,40}(?![0-9A-Za-z_])")


class NoProvenance(ValueError):
    """A marker names a result file that does not say which commit it measured."""


class Stamp(NamedTuple):
    """What a generated line says about one run; files with equal stamps share one clause."""

    commit: str | None
    dirty: bool | None
    day: str | None
    cpus: int | None


class Marked(NamedTuple):
    """One marker in a doc: its generated line as found (None: missing) and as it should be."""

    doc: Path
    line: int  # 1-based: the marker's own line
    found: str | None
    wanted: str


def docs(root: Path = SOURCE_ROOT) -> list[Path]:
    """The files the markers may sit in: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def stamp_of(report: dict[str, Any], name: str) -> Stamp:
    """``report``'s stamp; NoProvenance when it has no ``commit`` or ``dirty`` key (a null
    value is kept: the run was outside a git checkout)."""
    if "commit" not in report or "dirty" not in report:
        raise NoProvenance(f"{name} has no provenance (commit, dirty): regenerate it")
    when = report.get("when")
    cpus = report.get("cpus", report.get("config", {}).get("cpus"))
    return Stamp(report["commit"], report["dirty"],
                 when[:10] if isinstance(when, str) else None,
                 cpus if isinstance(cpus, int) else None)


def clause(stamp: Stamp, names: Sequence[str]) -> str:
    """``commit `abc1234` on a clean tree, 2026-12-02, 2 cores (`a.json`, `b.json`)``."""
    if stamp.commit is None:
        where = "outside a git checkout"
    else:
        tree = {False: "clean", True: "dirty", None: "unknown"}[stamp.dirty]
        where = f"commit `{stamp.commit[:SHORT_SHA]}` on a {tree} tree"
    extras = [where]
    if stamp.day is not None:
        extras.append(stamp.day)
    if stamp.cpus is not None:
        extras.append(f"{stamp.cpus} core{'s' if stamp.cpus != 1 else ''}")
    files = ", ".join(f"`{name}`" for name in names)
    return f"{', '.join(extras)} ({files})"


def measured_line(names: Sequence[str], root: Path = SOURCE_ROOT) -> str:
    """The generated line for the result files ``names`` (paths from ``root``), in their
    order; files measured in different runs get a clause each. OSError for a missing file,
    NoProvenance for one without provenance."""
    groups: dict[Stamp, list[str]] = {}
    for name in names:
        report = json.loads((root / name).read_text())
        groups.setdefault(stamp_of(report, name), []).append(name)
    clauses = [clause(stamp, members) for stamp, members in groups.items()]
    return GENERATED + "; at ".join(clauses) + "."


def marked(doc: Path, root: Path = SOURCE_ROOT) -> list[Marked]:
    """Every marker in ``doc``, in order, with its generated line as found and as wanted."""
    lines = doc.read_text().splitlines()
    found: list[Marked] = []
    for number, text in enumerate(lines, start=1):
        match = MARKER.match(text)
        if match is None:
            continue
        after = lines[number] if number < len(lines) else ""
        found.append(Marked(doc, number, after if after.startswith(GENERATED) else None,
                            measured_line(match["paths"].split(), root)))
    return found


def stale(root: Path = SOURCE_ROOT) -> list[Marked]:
    """The marked lines, in every doc, that are missing or differ from their files."""
    return [m for doc in docs(root) for m in marked(doc, root) if m.found != m.wanted]


def rewrite(doc: Path, root: Path = SOURCE_ROOT) -> bool:
    """Make every marked line of ``doc`` what its files say (inserting a missing one); True
    when the file changed. Lines outside markers are left as they are."""
    lines = doc.read_text().splitlines(keepends=True)
    changes = [m for m in marked(doc, root) if m.found != m.wanted]
    # From the end, so an insertion does not move the markers still to do.
    for m in reversed(changes):
        if m.found is None:
            lines.insert(m.line, m.wanted + "\n")
        else:
            lines[m.line] = m.wanted + "\n"
    if changes:
        doc.write_text("".join(lines))
    return bool(changes)


def named_commits(doc: Path, root: Path = SOURCE_ROOT) -> list[tuple[int, str, str]]:
    """(line number, token, line) for each commit of the git checkout at ``root`` that ``doc``
    names outside its markers and generated lines; [] outside a checkout."""
    lines = doc.read_text().splitlines()
    candidates: list[tuple[int, str, str]] = []
    skip = False
    for number, text in enumerate(lines, start=1):
        if skip and text.startswith(GENERATED):
            skip = False
            continue
        skip = MARKER.match(text) is not None
        if not skip:
            candidates += [(number, token, text) for token in HEX_TOKEN.findall(text)]
    commits = repo_commits(sorted({token for _, token, _ in candidates}), root)
    return [c for c in candidates if c[1] in commits]


def repo_commits(tokens: Sequence[str], root: Path) -> set[str]:
    """Those ``tokens`` that name a commit of the checkout at ``root`` (one ``git cat-file``)."""
    if not tokens or not (root / ".git").exists():
        return set()
    done = child_process.run(
        ["git", "-C", str(root), "cat-file", "--batch-check"],
        input="".join(f"{token}^{{commit}}\n" for token in tokens),
        capture_output=True, text=True, check=True, timeout=60)
    answers = done.stdout.splitlines()
    # One answer line per token, in order: "<sha> commit <size>", or "<token>^{commit} missing".
    return {token for token, answer in zip(tokens, answers, strict=True)
            if answer.split()[1:2] == ["commit"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.doc_provenance",
        description="Rewrite the docs' generated 'Measured at' lines from bench/results/*.json.")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 listing every stale or missing line")
    parser.add_argument("--root", type=Path, default=SOURCE_ROOT, help="the checkout")
    args = parser.parse_args(argv)
    if args.check:
        lines = stale(args.root)
        for m in lines:
            print(f"{m.doc.relative_to(args.root)}:{m.line + 1}: stale\n"
                  f"  found:  {m.found}\n  wanted: {m.wanted}")
        return 1 if lines else 0
    for doc in docs(args.root):
        if rewrite(doc, args.root):
            print(f"rewrote {doc.relative_to(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
