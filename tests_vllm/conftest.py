"""Logs of a test's processes in its failure report.

A test that starts processes puts a callable under ``item.stash[LOG_SECTIONS]``
(``tests_vllm.services``); when the test's setup or call fails, each ``(title, text)`` it
returns is added to that phase's report, which pytest prints with the failure, as it prints
captured output. A passing test prints nothing.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tests_vllm.services import LOG_SECTIONS


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    logs = item.stash.get(LOG_SECTIONS, None)
    if logs is not None and report.failed and report.when in ("setup", "call"):
        for title, text in logs():
            report.sections.append((title, text))
    return report
