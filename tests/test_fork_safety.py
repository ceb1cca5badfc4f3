"""Every fork in the kernel waits for a running warm import (``nb_dist/_kernel/_warm.py``).

A child forked while the kernel's background thread is half-way through importing a module
would inherit the half-imported module (and the import lock held by a thread it does not
have). The wait is an ``os.register_at_fork`` hook, so it covers every fork: a launch, its
probes, a restart, live ranks renewed by ``restart()`` or by themselves.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import pytest

from nb_dist._kernel import _warm

pytestmark = pytest.mark.timeout(60)

SLOW_MODULE = """
import os, time
open(os.path.join(os.environ["NB_DIST_TEST_DIR"], "started"), "w").close()
while not os.path.exists(os.path.join(os.environ["NB_DIST_TEST_DIR"], "go")):
    time.sleep(0.005)  # a handshake: the test creates "go"
DONE = True
"""


@pytest.fixture(autouse=True)
def warming_on(monkeypatch):
    """Each test starts with warming on for this process (a test's own thread, alive while
    the import ran, switches it off: "importing ... started a thread")."""
    monkeypatch.setattr(_warm, "_disabled_because", None)


@pytest.fixture
def slow_module(tmp_path, monkeypatch):
    """A module whose import blocks until the test says go (files as the handshake)."""
    name = f"nb_dist_slow_{os.getpid()}_{id(tmp_path)}"
    (tmp_path / f"{name}.py").write_text(SLOW_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NB_DIST_TEST_DIR", str(tmp_path))
    yield name, tmp_path
    (tmp_path / "go").touch()
    _warm.wait()
    sys.modules.pop(name, None)


def _wait_for(path, seconds=30.0):
    done = threading.Event()
    for _ in range(int(seconds / 0.01)):
        if path.exists():
            return
        done.wait(0.01)
    raise AssertionError(f"{path} never appeared")


def test_a_fork_during_a_warm_import_waits_and_the_child_has_the_whole_module(slow_module):
    name, folder = slow_module
    _warm.schedule([name])
    _wait_for(folder / "started")  # the warm thread is inside the module's import now
    read_end, write_end = os.pipe()
    forked = threading.Event()

    def fork() -> None:
        pid = os.fork()
        if pid == 0:  # the child: is the module there, and complete?
            module = sys.modules.get(name)
            os.write(write_end, b"complete" if getattr(module, "DONE", False) else b"partial")
            os._exit(0)
        forked.set()
        os.waitpid(pid, 0)

    thread = threading.Thread(target=fork)
    thread.start()
    # Without the hook the fork happens at once, mid-import; with it, it waits for "go".
    assert not forked.wait(1.0), "the fork did not wait for the warm import"
    (folder / "go").touch()
    thread.join(30)
    assert forked.is_set()
    assert os.read(read_end, 64) == b"complete"
    os.close(read_end)
    os.close(write_end)


def test_a_failed_warm_import_is_logged_not_swallowed(tmp_path, monkeypatch, caplog):
    name = f"nb_dist_broken_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text("raise RuntimeError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="nb_dist"):
        _warm.schedule([name])
        _warm.wait()
    assert name not in _warm.imported()
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("nb_dist")]
    assert any(name in m and "broken on purpose" in m for m in messages), messages


def test_what_a_cell_sets_during_a_warm_import_is_kept(slow_module, monkeypatch):
    """The warm import undoes only what importing torch sets (its inductor cache folder), not
    what the user's cell does to the environment meanwhile."""
    name, folder = slow_module
    monkeypatch.delenv("NB_DIST_TEST_CELL_VAR", raising=False)
    monkeypatch.setenv("NB_DIST_TEST_CHANGED", "before")
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    _warm.schedule([name])
    _wait_for(folder / "started")  # the warm thread is inside the module's import now
    os.environ["NB_DIST_TEST_CELL_VAR"] = "set by a cell"
    os.environ["NB_DIST_TEST_CHANGED"] = "changed by a cell"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = "/tmp/set-during-the-import"  # as torch's import does
    (folder / "go").touch()
    _warm.wait()
    try:
        assert os.environ.get("NB_DIST_TEST_CELL_VAR") == "set by a cell"
        assert os.environ.get("NB_DIST_TEST_CHANGED") == "changed by a cell"
        assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == cache  # undone
    finally:
        os.environ.pop("NB_DIST_TEST_CELL_VAR", None)


def test_a_warm_import_that_does_not_finish_is_given_up_on_not_waited_for(slow_module):
    """An import stuck for ever must not hang every later fork: past the limit the wait
    ends, warming is switched off, and the next launch says so."""
    name, folder = slow_module
    _warm.schedule([name])
    _wait_for(folder / "started")
    assert _warm.wait(limit=0.3) >= 0.3  # returned at the limit; the import still runs
    assert not _warm.enabled(True)
    notice = _warm.take_notice()
    assert notice is not None and name in notice and "did not finish" in notice


def _square(x: int) -> int:
    return x * x


def test_the_off_notice_goes_to_the_first_fork_launch_that_is_not_refused(slow_module):
    """Warm relaunches switched off are said once, by a fork launch that asked for them:
    not used up by a launch refused before it starts, nor by a spawn launch."""
    from nb_dist._kernel._arguments import LaunchOptions
    from nb_dist._kernel._transport import prepare

    name, folder = slow_module
    _warm.schedule([name])
    _wait_for(folder / "started")
    assert _warm.wait(limit=0.3) >= 0.3  # warming is off now, with a notice to give

    def decided(args: tuple, **options: object):
        asked = LaunchOptions(num_processes=2, device="cpu", threads_per_process=1, **options)
        return prepare(_square, args, asked, cluster=None)[1]

    with pytest.raises(TypeError, match="must send the function and args"):
        decided((threading.Lock(),), start_method="spawn")  # refused: does not pickle
    spawned, forked, again = decided((3,), start_method="spawn"), decided((3,)), decided((3,))
    said = [[n for n in plan.notices if "Warm relaunches are off" in n]
            for plan in (spawned, forked, again)]  # fmt: skip
    assert [len(s) for s in said] == [0, 1, 0], said
    assert name in said[1][0]
