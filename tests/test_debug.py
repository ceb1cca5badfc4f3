"""Debugging a rank from the notebook, in a real kernel whose input requests a test answers.

``execute_answering`` plays JupyterLab's input box: each ``input_request`` (the box pdb's
prompt appears in) gets the next scripted line. ``execute`` runs cells as nbval does, with
``allow_stdin=False``: no prompt may appear then, only a message.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from kernel_helpers import (
    execute,
    execute_answering,
    kernel_pid,
    line_in,
)
from process_helpers import assert_all_gone

from nb_dist import LaunchTimeoutError, notebook_launcher

pytestmark = pytest.mark.timeout(180)

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

FAILING = """
import nb_dist, torch.distributed as dist
def g(x):
    y = x * 3
    raise ValueError(f"bad {y}")
def f():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        g(7)
    dist.barrier()
nb_dist.notebook_launcher(f, num_processes=2, debug="postmortem")
"""

PAUSING = """
import nb_dist, torch.distributed as dist
def f():
    dist.init_process_group("gloo")
    secret = 41 + dist.get_rank()
    nb_dist.breakpoint(rank=1)
    after = secret * 2
    print("after", after)
    dist.barrier()
    return after
result = nb_dist.notebook_launcher(f, num_processes=2, timeout=60)
print(list(result))
"""


def _like_nbval(kc, code: str):
    """Run ``code`` as nbval and nbconvert do: no frontend can answer an input request."""
    kc.allow_stdin = False
    try:
        return execute(kc, code)
    finally:
        kc.allow_stdin = True


def _text(run) -> str:
    return _ANSI.sub("", run.stdout())


def _fail(kc) -> int:
    """Run the failing launch (its error left uncaught, as in a notebook); the held rank's pid."""
    run = execute(kc, FAILING)
    assert run.error is not None and run.error["ename"] == "WorkerFailedError"
    text = run.error["evalue"]
    assert text.startswith("rank 1 failed first: ValueError: bad 21"), text
    assert "Rank 1 is kept at its exception for a post-mortem: run %debug" in text
    code = "import sys\nerr = sys.last_value\nprint(err.post_mortem.rank.process.pid)"
    return int(execute(kc, code).expect_ok().stdout())


# ----------------------------------------------------------------------------- post-mortem
@pytest.mark.fast
def test_post_mortem_opens_pdb_in_the_failed_rank(kernel):
    _, kc = kernel
    pid = _fail(kc)
    answers = ["p y", "p locals()", "u", "p dist.get_rank()", "d", "l", "q"]
    talk = execute_answering(kc, "%debug", answers)
    talk.run.expect_ok()
    assert talk.prompts == ["[rank 1] (Pdb) "] * 7
    out = _text(talk.run)
    assert 'raise ValueError(f"bad {y}")' in out  # the failing frame's source line
    assert "\n21\n" in out  # p y
    assert "{'x': 7, 'y': 21}" in out  # its locals
    assert "g(7)" in out  # `u` went to the caller, f
    assert "\n1\n" in out  # an expression in f's frame
    assert os.path.join("nb_dist", "_") not in out  # nb_dist's own frames are not shown
    assert_all_gone([pid])  # q released the rank
    again = execute(kc, "err.debug()").expect_ok()
    assert "no longer held" in again.stdout()
    # The kernel is usable: the next launch works.
    execute(kc, "print(list(nb_dist.notebook_launcher(lambda: 5, num_processes=2)))").expect_ok()


def test_err_debug_is_the_same_and_where_shows_the_stack(kernel):
    _, kc = kernel
    pid = _fail(kc)
    talk = execute_answering(kc, "err.debug()", ["w", "q"])
    talk.run.expect_ok()
    out = _text(talk.run)
    assert "f()" in out and "g()" in out
    assert_all_gone([pid])


def test_without_a_frontend_debug_says_how_and_never_prompts(kernel):
    _, kc = kernel
    pid = _fail(kc)
    run = _like_nbval(kc, "%debug").expect_ok()
    assert "this run cannot answer its prompts" in run.stdout()
    assert "run the cell in JupyterLab" in run.stdout()
    assert_all_gone([pid])


def test_the_next_launch_releases_a_rank_nobody_debugged(kernel):
    _, kc = kernel
    pid = _fail(kc)
    execute(kc, "nb_dist.notebook_launcher(lambda: None, num_processes=1)").expect_ok()
    assert_all_gone([pid])


def test_a_held_rank_dies_with_the_kernel(kernel):
    km, kc = kernel
    pid = _fail(kc)
    os.kill(kernel_pid(km), signal.SIGKILL)
    assert_all_gone([pid], within=2.0)


@pytest.mark.fast
def test_debug_mode_is_checked():
    with pytest.raises(
        ValueError, match=r"debug='later' is not supported. Use one of 'postmortem'"
    ):
        notebook_launcher(lambda: None, num_processes=1, debug="later")


# ----------------------------------------------------------------------------- breakpoint
def test_breakpoint_stops_one_rank_and_continues(kernel):
    _, kc = kernel
    talk = execute_answering(kc, PAUSING, ["p secret", "n", "p after", "c"])
    talk.run.expect_ok()
    assert talk.prompts == ["[rank 1] (Pdb) "] * 4  # rank 1 only
    out = _text(talk.run)
    assert "rank 1 paused" in out
    assert "\n42\n" in out and "\n84\n" in out  # p secret, then p after the `n`
    assert "[rank 0] after 82" in out and "[rank 1] after 84" in out
    assert out.rstrip().endswith("[82, 84]")


def test_breakpoint_without_a_frontend_goes_on_with_a_message(kernel):
    _, kc = kernel
    run = _like_nbval(kc, PAUSING).expect_ok()
    raw = run.stdout()
    # Plain text only: pdb's coloured rendering (which IPython releases change) is not kept
    # where nobody reads it, only where the rank stopped, as a traceback would name it.
    assert "\x1b[" not in raw, repr(raw)
    out = _text(run)
    after = line_in(PAUSING, "after = secret * 2")
    assert (
        f"rank 1 stopped at Cell In[{run.execution_count}], line {after}, in f\n"
        "    after = secret * 2\n"
    ) in out, out
    assert "paused; c goes on" not in out  # pdb's own text is for a person at the prompt
    assert "rank 1 is in the debugger, but this run cannot answer its prompts" in out
    assert "The rank goes on" in out
    assert out.rstrip().endswith("[82, 84]")


@pytest.mark.parametrize("call", ["breakpoint()", "__import__('pdb').set_trace()"])
def test_pythons_breakpoint_in_a_rank_is_routed_to_the_notebook(kernel, call):
    _, kc = kernel
    code = f"import nb_dist\ndef f():\n    v = 7\n    {call}\n    return v\n"
    code += "print(list(nb_dist.notebook_launcher(f, num_processes=1)))"
    talk = execute_answering(kc, code, ["v = 8", "c"])
    talk.run.expect_ok()
    assert talk.prompts == ["[rank 0] (Pdb) "] * 2
    assert _text(talk.run).rstrip().endswith("[8]")


def test_live_ranks_post_mortem_in_the_failing_cell(kernel):
    _, kc = kernel
    execute(kc, "import nb_dist\nranks = nb_dist.Ranks(2, debug='postmortem')").expect_ok()
    execute(kc, "ranks.exec('import torch.distributed as dist')").expect_ok()
    cell = "ranks.exec('z = 5\\nif dist.get_rank() == 0:\\n    1 / (z - 5)')"
    talk = execute_answering(kc, cell, ["p z", "q"])
    assert talk.prompts == ["[rank 0] (Pdb) "] * 2
    assert "\n5\n" in _text(talk.run)
    assert talk.run.error["ename"] == "WorkerFailedError"
    assert "ZeroDivisionError" in talk.run.error["evalue"]
    assert "still usable" in talk.run.error["evalue"]
    assert execute(kc, "ranks.exec('z')").expect_ok().result_text == "LaunchResult([5, 5])"
    pids = json.loads(execute(kc, "import json; print(json.dumps(ranks.pids))").stdout())
    execute(kc, "ranks.close()").expect_ok()
    assert_all_gone(pids)


# ----------------------------------------------------------------------------- hangs
def _skips_a_collective(folder: str) -> None:
    import pathlib

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)  # both ranks: collective 1
    if dist.get_rank() == 0:
        dist.all_reduce(t)  # rank 0 only: collective 2, waits forever
    else:
        pathlib.Path(folder, "stuck").write_text("1")
        while True:  # rank 1 is busy elsewhere (a data loader, say)
            time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_hang_report_names_each_ranks_collective_count(tmp_path):
    with pytest.raises(LaunchTimeoutError) as info:
        notebook_launcher(_skips_a_collective, (str(tmp_path),), num_processes=2, timeout=4)
    text = str(info.value)
    assert "rank 0 waits in all_reduce #2" in text
    assert "rank 1 entered only 1 collective" in text


def test_breakpoint_works_with_grouped_output(kernel):
    """output="grouped" holds the ranks' lines until the end; the debugger still talks live."""
    _, kc = kernel
    code = PAUSING.replace("timeout=60", "timeout=60, output='grouped'")
    talk = execute_answering(kc, code, ["p secret", "c"])
    talk.run.expect_ok()
    assert talk.prompts == ["[rank 1] (Pdb) "] * 2
    out = _text(talk.run)
    assert out.index("\n42\n") < out.index("[rank 0] after 82")  # pdb first, lines at the end
    assert out.rstrip().endswith("[82, 84]")


def _fails_on_rank_1(folder: str) -> None:
    import pathlib

    rank = int(os.environ["RANK"])
    pathlib.Path(folder, f"pid{rank}-{os.getpid()}").write_text("1")
    if rank == 1:
        raise ValueError("again")


@pytest.mark.timeout(120)
def test_with_restarts_only_the_last_failure_is_kept_for_a_post_mortem(tmp_path):
    from nb_dist import WorkerFailedError

    with pytest.raises(WorkerFailedError) as info:
        notebook_launcher(
            _fails_on_rank_1, (str(tmp_path),), num_processes=2, max_restarts=1,
            debug="postmortem", output="none",
        )  # fmt: skip
    held = info.value.post_mortem
    try:
        rank1 = [int(p.name.split("-")[1]) for p in tmp_path.glob("pid1-*")]
        assert len(rank1) == 2
        assert held.rank.process.pid == max(rank1, key=lambda pid: tmp_path.joinpath(
            f"pid1-{pid}").stat().st_mtime_ns)  # fmt: skip
        earlier = [pid for pid in rank1 if pid != held.rank.process.pid]
        assert_all_gone(earlier)  # the first attempt's failed rank was not kept
    finally:
        held.release()


# ----------------------------------------------------------------------------- at a prompt
def test_a_rank_that_dies_at_the_prompt_ends_the_cell(kernel):
    """A command that kills the paused rank (or an OOM kill meanwhile): the cell ends with
    the rank's exit, not a wait for a prompt that never comes."""
    _, kc = kernel
    talk = execute_answering(kc, PAUSING, ["import os; os._exit(3)"], timeout=60)
    assert talk.run.error is not None and talk.run.error["ename"] == "WorkerFailedError"
    assert "rank 1 failed first: the process exited with code 3" in talk.run.error["evalue"]


def test_interrupting_at_a_prompt_quits_the_debugger_and_keeps_the_session(kernel):
    km, kc = kernel
    execute(kc, "import nb_dist\nranks = nb_dist.Ranks(2)").expect_ok()
    execute(kc, "ranks.exec('import nb_dist, torch.distributed as dist\\ny = 1')").expect_ok()
    cell = "ranks.exec('nb_dist.breakpoint(rank=0)\\ny = 7')"
    talk = execute_answering(kc, cell, [km.interrupt_kernel], timeout=60)
    assert talk.prompts == ["[rank 0] (Pdb) "]
    assert talk.run.error["ename"] == "KeyboardInterrupt"
    assert "still usable" in talk.run.error["evalue"]
    # Rank 0 quit in pdb before its next line; rank 1 never waits at a breakpoint for another
    # rank's pdb (only at its next collective), so it had finished the cell.
    assert execute(kc, "ranks.pull('y')").expect_ok().result_text == "LaunchResult([1, 7])"
    execute(kc, "ranks.close()").expect_ok()
