"""The vLLM tests' failure reports carry the tail of every engine's log: a CI run (ctest
--output-on-failure) deletes the engines' log files with its temporary folder, and a failed
disaggregated request (HTTP 500: vLLM's "fail" policy after a failed KV load) says nothing of
why; the connector's warning lines in the decode engine's log do."""

from __future__ import annotations

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test module's engine_log_tails() (test_pd: the last lines of each running engine's
    log) goes into the report of a test, or fixture, that fails."""
    outcome = yield
    report = outcome.get_result()
    tails = getattr(item.module, "engine_log_tails", None)
    if report.failed and tails is not None:
        text = tails()
        if text:
            report.sections.append(("engine logs", text))
