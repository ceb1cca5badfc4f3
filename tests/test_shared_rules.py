"""The rules both sides share, one place each: loopback names, environment switches, and
the launcher's options as one typed object that matches the public signatures."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from nb_dist import Ranks, notebook_launcher
from nb_dist._kernel._arguments import LaunchOptions
from nb_dist._shared._env import switched_off
from nb_dist._shared._net import is_loopback

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    "host", ["localhost", "localhost.localdomain", "ip6-localhost", "127.0.0.1", "127.1.2.3",
             "::1", "[::1]"],
)  # fmt: skip
def test_loopback_names(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["10.0.0.1", "example.org", "node-1", "", "[::2]", "0.0.0.0"])
def test_other_hosts_are_not_loopback(host):
    assert not is_loopback(host)


@pytest.mark.parametrize("value", ["0", "false", "No", " OFF "])
def test_a_switch_is_off(monkeypatch, value):
    monkeypatch.setenv("NB_DIST_TEST_SWITCH", value)
    assert switched_off("NB_DIST_TEST_SWITCH")


@pytest.mark.parametrize("value", ["1", "true", "yes", "", "anything"])
def test_a_switch_is_on(monkeypatch, value):
    monkeypatch.setenv("NB_DIST_TEST_SWITCH", value)
    assert not switched_off("NB_DIST_TEST_SWITCH")


def test_an_unset_switch_is_on(monkeypatch):
    monkeypatch.delenv("NB_DIST_TEST_SWITCH", raising=False)
    assert not switched_off("NB_DIST_TEST_SWITCH")


def test_the_options_are_the_launchers_parameters_with_its_defaults():
    """A new option is added to the signature and to LaunchOptions, or this fails."""
    params = inspect.signature(notebook_launcher).parameters
    # cluster= is where the ranks run (the launch's transport), not an option of the plan.
    skipped = ("function", "args", "cluster")
    launcher = {n: p.default for n, p in params.items() if n not in skipped}
    options = {f.name: f.default for f in dataclasses.fields(LaunchOptions)}
    assert options == launcher


def test_ranks_options_are_the_launchers_where_they_share_a_name():
    params = inspect.signature(Ranks).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(LaunchOptions)}
    shared = {n: p.default for n, p in params.items() if n in defaults and n != "timeout"}
    assert shared and all(defaults[n] == d for n, d in shared.items()), shared


def test_options_travel_by_keyword_only():
    with pytest.raises(TypeError):
        LaunchOptions(2)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        LaunchOptions().timeout = 3  # type: ignore[misc]
