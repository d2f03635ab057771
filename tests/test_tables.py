"""``render_table``: numbers right-aligned whatever their sign, separators or unit."""

from __future__ import annotations

from kvcoord.tables import render_table


def test_numbers_align_right_with_signs_separators_and_units() -> None:
    table = render_table(["what", "error", "count", "ratio"],
                         [["a", "+97%", "1,229", "3.5x"], ["bb", "-4%", "12", "10.25x"]])
    first, second = table.splitlines()[2:]
    assert first.endswith("  +97%  1,229    3.5x")
    assert second.endswith("   -4%     12  10.25x")
    # Words stay left-aligned: the first column starts at the margin.
    assert second.startswith("bb  ") and first.startswith("a   ")
