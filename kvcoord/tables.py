"""Plain-text tables for terminal reports (no dependency, right-aligned numbers)."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns sized to the widest cell; cells that look numeric are right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            numeric = _looks_numeric(cell)
            out.append(cell.rjust(widths[i]) if numeric else cell.ljust(widths[i]))
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def _looks_numeric(cell: str) -> bool:
    """``1,229``, ``-42%``, ``+97%``, ``3.5x``, ``v2``: a number, its sign, separators and unit."""
    bare = cell.replace(",", "").replace(".", "").replace("%", "").replace("x", "")
    return bare.lstrip("-+v").isdigit()
