"""Shared fixtures: every test that launches must leave no process of its launch behind."""

from __future__ import annotations

import contextlib
import os
import time

import psutil
import pytest

# The must-fail notebook is run on purpose by test_notebook_harness.py, never collected here.
collect_ignore = ["broken_notebooks"]

# Keep ranks cheap on 2-core CI machines.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _descendants() -> dict[int, str]:
    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                found[child.pid] = " ".join(child.cmdline()[:4])
        except psutil.Error:
            pass
    return found


def _is_helper(cmdline: str) -> bool:
    # multiprocessing's long-lived helpers (forkserver, resource tracker) are not workers.
    # Chromium (tests/browser) starts utility services lazily, whenever it likes; they belong
    # to the browser, whose module-scoped fixture closes it and checks that nothing is left.
    chromium_service = "chrom" in cmdline and "--type=utility" in cmdline
    return "forkserver" in cmdline or "resource_tracker" in cmdline or chromium_service


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail the test if a process it started is still alive 3 s after it ended."""
    before = set(_descendants())
    yield
    deadline = time.monotonic() + 3
    left = {}
    while time.monotonic() < deadline:
        left = {
            pid: cmd
            for pid, cmd in _descendants().items()
            if pid not in before and not _is_helper(cmd)
        }
        if not left:
            return
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    pytest.fail(f"processes left behind by this test: {left}")
