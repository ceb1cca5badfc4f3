"""The throw-away child that asks the CUDA driver has a deadline that works
(``nb_dist/_kernel/_preflight.py``): a wedged driver makes the launch refuse with what to do,
it never hangs every launch in silence, and the child is not left behind."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from nb_dist._kernel._preflight import ask_in_child
from nb_dist._starter._processes import REAP_WITHIN

pytestmark = [pytest.mark.fast, pytest.mark.timeout(60)]


def _children() -> set[int]:
    """This process's children, zombies (ended, not reaped) included."""
    return {c.pid for c in psutil.Process().children()}


def test_an_answer_comes_back():
    assert ask_in_child(lambda: {"count": 3, "bad": False, "pid": os.getpid()}, 30.0)["count"] == 3


def test_a_child_that_never_answers_is_killed_at_the_deadline_and_reaped():
    before = _children()
    began = time.monotonic()
    assert ask_in_child(lambda: time.sleep(600) or {}, 0.5) is None
    # Returned at its deadline (then the kill is reaped within REAP_WITHIN), not after the sleep.
    assert time.monotonic() - began < 0.5 + REAP_WITHIN
    assert _children() == before  # killed and reaped: nothing left, not even a zombie


def test_a_child_that_fails_gives_an_empty_answer_not_an_error():
    def broken() -> dict:
        raise RuntimeError("driver said no")

    assert ask_in_child(broken, 30.0) == {}
