"""The live launch monitor: skipped outside a kernel, widget state driven by the observer hooks,
and shown and updated in a real ipykernel while the ranks run.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import collect, execute, send, wait_for

import nb_dist
from nb_dist import RankOutcome, ReportEntry, notebook_launcher
from nb_dist._kernel._monitor import LaunchMonitor, kernel_frontend_possible

WIDGET_KEY = "application/vnd.jupyter.widget-view+json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- worker functions
def _train_a_little():
    for step in nb_dist.progress(range(5), desc="train"):
        nb_dist.report("loss", 1.0 / (step + 1))
    print(f"hello from {nb_dist.rank()}")
    return nb_dist.rank()


# ----------------------------------------------------------------------------- widget helpers
def _row(monitor: LaunchMonitor, local: int):
    """(row, state, bar, tail) widgets of one rank, found through the public widget tree."""
    row = monitor.widget.children[1 + local]
    header, tail = row.children
    _label, state, bar = header.children
    return row, state, bar, tail


def _plot(monitor: LaunchMonitor):
    return monitor.widget.children[-1]


# ----------------------------------------------------------------------------- outside a kernel
@pytest.mark.fast
def test_monitor_true_outside_a_kernel_runs_with_plain_labelled_output(capsys):
    """monitor=True in a script: no widget is displayed, the labelled text output is all."""
    assert not kernel_frontend_possible()
    result = notebook_launcher(_train_a_little, num_processes=2, monitor=True)
    assert list(result) == [0, 1]
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"[rank {rank}] hello from {rank}" in out
        assert f"[rank {rank}] train: 5/5 done in" in out
        assert result.reports.series("loss", rank) == (
            [0, 1, 2, 3, 4],
            [1.0, 0.5, 1 / 3, 0.25, 0.2],
        )
    assert "LaunchMonitor" not in out  # display() outside IPython would print the repr


@pytest.mark.fast
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_monitor_must_be_a_bool(value):
    """monitor= anything but True/False is refused with a TypeError naming it."""
    with pytest.raises(TypeError) as caught:
        notebook_launcher(_train_a_little, num_processes=2, monitor=value)
    assert str(caught.value) == f"monitor={value!r} must be True or False."


# ----------------------------------------------------------------------------- observer hooks
@pytest.mark.fast
def test_monitor_widgets_follow_the_observer_hooks():
    """started/lines/progress/reports/finished/close drive the rows, bar, plot and classes."""
    monitor = LaunchMonitor([0, 1])
    assert monitor.widget.children[0].value == "<b>nb_dist launch</b>: 2 ranks"
    for local in (0, 1):
        row, state, bar, _tail = _row(monitor, local)
        assert "<b>starting</b>" in state.value
        assert "nb-dist-status-starting" in row._dom_classes
        assert f"nb-dist-monitor-rank-{local}" in row._dom_classes
        assert bar.layout.visibility == "hidden"
    assert _plot(monitor).layout.display == "none"

    monitor.started(0)
    monitor.started(1)
    monitor.lines(0, "stdout", ["line a", "line b", "line c", "line d", "line <e>"])
    monitor.progress(0, "train", 25, 50)
    monitor.progress(1, "eval", 3, None)
    monitor.reports(0, [("loss", ReportEntry(0, 1.0)), ("loss", ReportEntry(1, 0.5))])
    monitor.reports(
        1,
        [
            ("loss", ReportEntry(0, 2.0)),
            ("grad", ReportEntry(0, torch.ones(3))),  # not a scalar: not plotted
            ("flag", ReportEntry(0, True)),  # a bool is not a curve either
        ],
    )
    assert sorted(monitor.scalars) == ["loss"]
    assert monitor.scalars["loss"] == {0: ([0, 1], [1.0, 0.5]), 1: ([0], [2.0])}
    monitor.refresh(force=True)

    row0, state0, bar0, tail0 = _row(monitor, 0)
    row1, state1, bar1, _tail1 = _row(monitor, 1)
    assert "<b>running</b>" in state0.value and "train 25/50" in state0.value
    assert "nb-dist-status-running" in row0._dom_classes
    assert "nb-dist-status-starting" not in row0._dom_classes
    assert bar0.value == pytest.approx(0.5) and bar0.layout.visibility == "visible"
    assert "eval 3" in state1.value and bar1.layout.visibility == "hidden"  # no total: no bar
    assert "line a" not in tail0.value  # only the last 4 lines
    assert "line b" in tail0.value and "line &lt;e&gt;" in tail0.value  # HTML-escaped
    png = bytes(_plot(monitor).value)
    assert png.startswith(PNG_MAGIC) and _plot(monitor).layout.display is None

    monitor.progress(0, "train", 50, 50)
    monitor.reports(0, [("loss", ReportEntry(2, 0.25))])
    monitor.finished(0, RankOutcome(rank=0, local_rank=0, status="ok"))
    monitor.finished(
        1,
        RankOutcome(
            rank=1, local_rank=1, status="failed", exc_type="ValueError", message="bad batch 7"
        ),
    )
    monitor.close()

    assert "<b>done</b>" in state0.value and "train 50/50" in state0.value
    assert bar0.value == 1.0
    assert "nb-dist-status-done" in row0._dom_classes
    assert "nb-dist-status-running" not in row0._dom_classes
    assert "<b>failed</b>" in state1.value
    assert "nb-dist-status-failed" in row1._dom_classes
    assert "nb-dist-status-running" not in row1._dom_classes
    assert "⚠ ValueError: bad batch 7" in _row(monitor, 1)[3].value
    assert "⚠" not in tail0.value
    new_png = bytes(_plot(monitor).value)
    assert new_png.startswith(PNG_MAGIC) and new_png != png, "close() must redraw the curves"

    bundle = monitor._repr_mimebundle_()
    assert bundle["text/plain"] == "LaunchMonitor(2 ranks)"
    assert bundle[WIDGET_KEY]["model_id"] == monitor.widget.model_id
    assert repr(monitor) == "LaunchMonitor(2 ranks)"


@pytest.mark.fast
def test_monitor_close_after_an_interrupt_marks_live_ranks_stopped():
    """close(interrupted=True): ranks still starting or running show 'stopped'; collateral
    failures show as failed with their message."""
    monitor = LaunchMonitor([2, 3])  # e.g. node 1 of a 2-node launch
    monitor.started(0)
    monitor.finished(
        1,
        RankOutcome(
            rank=3,
            local_rank=1,
            status="collateral",
            exc_type="DistBackendError",
            message="Connection closed by peer",
        ),
    )
    monitor.close(interrupted=True)
    row0, state0, _, _ = _row(monitor, 0)
    row1, state1, _, tail1 = _row(monitor, 1)
    assert "<b>stopped</b>" in state0.value and "nb-dist-status-stopped" in row0._dom_classes
    assert "<b>failed</b>" in state1.value and "nb-dist-status-failed" in row1._dom_classes
    assert "⚠ DistBackendError: Connection closed by peer" in tail1.value
    assert "rank 2" in monitor.widget.children[1].children[0].children[0].value


# ----------------------------------------------------------------------------- in a real kernel
MONITOR_SETUP = """
import time
from pathlib import Path
import nb_dist

def train(folder):
    for step in nb_dist.progress(range(24), desc="train"):
        nb_dist.report("loss", 1.0 / (step + 1))
        if step == 12:  # mid-run: wait until the test has seen the monitor show this progress
            go, deadline = Path(folder, "go"), time.monotonic() + 90
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        time.sleep(0.05)
    print("finished", nb_dist.rank())
    return nb_dist.rank()
"""

KERNEL_LAUNCH = """
result = nb_dist.notebook_launcher(train, args=({folder!r},), num_processes=2, monitor=True)
print("reports", {{r: len(v) for r, v in result.reports["loss"].items()}})
"""


def _progress_mid_run(msg) -> bool:
    """A widget update that sets a progress bar between empty and full."""
    if msg.msg_type != "comm_msg" or msg.content["data"].get("method") != "update":
        return False
    value = msg.content["data"]["state"].get("value")
    return isinstance(value, float) and 0.0 < value < 1.0


@pytest.mark.kernel
@pytest.mark.timeout(120)
def test_monitor_in_a_real_kernel_displays_and_updates_widgets(kernel, tmp_path):
    _, kc = kernel
    """In ipykernel: the monitor is displayed in the cell, updated over comm messages while the
    ranks run, the labelled text output is still printed, and nothing comes after idle."""
    execute(kc, MONITOR_SETUP, timeout=90).expect_ok()
    run = send(kc, KERNEL_LAUNCH.format(folder=str(tmp_path)))
    # Updates arrive while the ranks run, not all at the end: the ranks stop at step 12 of 24
    # until the cell has shown a bar between empty and full (they would wait 90 s, longer
    # than this wait, if the monitor only drew at the end).
    wait_for(kc, run, _progress_mid_run, timeout=45)
    (tmp_path / "go").touch()
    collect(kc, run, timeout=60, late_window=1.0).expect_ok()

    displays = [m for m in run.mine if m.msg_type == "display_data"]
    monitors = [
        m for m in displays if m.content["data"].get("text/plain") == "LaunchMonitor(2 ranks)"
    ]
    assert len(monitors) == 1, [m.content["data"].get("text/plain") for m in displays]
    view = monitors[0].content["data"][WIDGET_KEY]
    assert view["model_id"]

    opened = [m for m in run.mine if m.msg_type == "comm_open"]
    updates = [
        m
        for m in run.mine
        if m.msg_type == "comm_msg" and m.content["data"].get("method") == "update"
    ]
    assert any(m.content["comm_id"] == view["model_id"] for m in opened)
    assert len(updates) >= 5, len(updates)
    bar_values = [
        m.content["data"]["state"]["value"]
        for m in updates
        if isinstance(m.content["data"]["state"].get("value"), float)
    ]
    assert any(0.0 < v < 1.0 for v in bar_values), f"no progress shown mid-run: {bar_values}"
    assert 1.0 in bar_values
    states = [str(m.content["data"]["state"].get("value")) for m in updates]
    assert any("<b>running</b>" in s for s in states)
    assert any("<b>done</b>" in s for s in states)
    assert any(["value"] in m.content["data"].get("buffer_paths", []) for m in updates), (
        "the curves image was never sent"
    )

    out = run.stdout()
    for rank in (0, 1):
        assert f"[rank {rank}] train: 24/24 done in" in out
        assert f"[rank {rank}] finished {rank}" in out
    assert "reports {0: 24, 1: 24}" in out
    assert not run.late


@pytest.mark.fast
def test_monitor_shows_a_rank_paused_in_the_debugger():
    """paused(True) while a rank waits at a pdb prompt (nb_dist.breakpoint), then running."""
    monitor = LaunchMonitor([0, 1])
    monitor.started(0)
    monitor.started(1)
    monitor.paused(1, True)
    row1, state1, _bar, _tail = _row(monitor, 1)
    assert "<b>paused</b>" in state1.value
    assert "nb-dist-status-paused" in row1._dom_classes
    assert "<b>running</b>" in _row(monitor, 0)[1].value
    monitor.paused(1, False)
    monitor.refresh(force=True)
    assert "<b>running</b>" in state1.value
    assert "nb-dist-status-paused" not in row1._dom_classes


RANKS_WITH_MONITOR = """
import nb_dist
ranks = nb_dist.Ranks(2, monitor=True)
result = ranks.exec("import nb_dist\\nfor i in nb_dist.progress(range(3), desc='cell'):\\n"
                    "    nb_dist.report('loss', 1.0 / (i + 1))\\nnb_dist.rank()")
print(list(result), {r: len(v) for r, v in result.reports["loss"].items()})
ranks.close()
"""


@pytest.mark.kernel
@pytest.mark.timeout(120)
def test_live_ranks_show_the_monitor_in_each_cell(kernel):
    _, kc = kernel
    """Ranks(monitor=True): each task displays the monitor, which ends with every rank done."""
    run = execute(kc, RANKS_WITH_MONITOR, timeout=90).expect_ok()
    monitors = [
        m
        for m in run.mine
        if m.msg_type == "display_data"
        and m.content["data"].get("text/plain") == "LaunchMonitor(2 ranks)"
    ]
    assert len(monitors) == 1
    states = [
        str(m.content["data"]["state"].get("value"))
        for m in run.mine
        if m.msg_type == "comm_msg" and m.content["data"].get("method") == "update"
    ]
    assert any("<b>done</b>" in s for s in states)
    assert "[0, 1] {0: 3, 1: 3}" in run.stdout()
