"""How the supervisor's loop ends its ranks: stop them, drain and reap them, close its ends.

Three steps, each a function over the ranks it is handed, so the loop (``_supervisor.py``)
decides which ranks and when, and this module only how: a stop is SIGTERM to each rank's
process group, then SIGKILL after :data:`STOP_GRACE`; a drain reads what the ranks still
write until each has finished, then kills and reaps what is left by one deadline
(``_processes.REAP_WITHIN``) and writes their last lines; a close unregisters and closes the
kernel's pipe ends, then the lifeline and the host. A rank held for a post-mortem is never
stopped and keeps its pipes. The loop reads while waiting (``read_until``), so output written
during a teardown still lands in the cell.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from .._starter._parts import DRAIN_AFTER_EXIT
from ._output import OutputRouter
from ._pump import Pump
from ._rank_handle import Rank, kill_all

# How long a stopped rank gets between SIGTERM and SIGKILL; keeps "stopped within 1 s".
STOP_GRACE = 0.4
# How long the last lines still waiting in the ranks' pipes are read at the end, all ranks
# together (a grandchild may keep writing into a pipe for ever).
LAST_LINES_WITHIN = 0.5

#: The loop's ``read_until(done, seconds)``: read the pipes and notice ended ranks until
#: ``done()`` or ``seconds`` pass; whether done.
ReadUntil = Callable[[Callable[[], bool], float], bool]


def stop(live: list[Rank], read_until: ReadUntil) -> None:
    """SIGTERM every rank in ``live`` (its process group), then SIGKILL what is left after
    :data:`STOP_GRACE`: the rank gets a moment to flush and exit, never more."""
    for rank in live:
        rank.request_stop()
        assert rank.process is not None
        rank.process.send_signal(signal.SIGTERM)
    read_until(lambda: not any(rank.alive for rank in live), STOP_GRACE)
    for rank in live:
        if rank.alive and rank.process is not None:
            rank.process.send_signal(signal.SIGKILL)


def drain_and_reap(
    ranks: list[Rank],
    router: OutputRouter,
    read_until: ReadUntil,
    finalize: Callable[[Rank], None],
) -> None:
    """Read ``ranks`` until each has finished; if one has not within a drain and a stop's
    grace, kill every group at once and reap all by one deadline (a teardown waits
    ``REAP_WITHIN`` at most, however many ranks are stuck), ``finalize`` deciding the outcome
    of each still unfinished. Then write every rank's last lines, so nothing is lost."""
    if not read_until(lambda: all(rank.finished for rank in ranks), DRAIN_AFTER_EXIT + STOP_GRACE):
        kill_all(ranks)
        for rank in ranks:
            if not rank.finished:
                finalize(rank)
    drained_by = time.monotonic() + LAST_LINES_WITHIN  # for all ranks together
    for rank in ranks:
        rank.drain_streams(router, drained_by)  # its last lines, if still in the pipe
        for kind, splitter in rank.splitters.items():
            router.lines(rank.index, kind, splitter.flush())


def close(
    ranks: list[Rank],
    pump: Pump,
    held: Rank | None,
    lifeline: Connection | None,
    end_host: Callable[[], None],
) -> None:
    """Stop reading and close the kernel's pipe ends (``held``'s stay open), then the
    lifeline and the host (``end_host``: the ``RankHost``'s ``close``), unless a live
    ``held`` rank's post-mortem ends them later (``_prompts.PostMortem``): its pipes and
    lifeline are what its debugger talks over."""
    for rank in ranks:
        for conn in rank.pipes.values():
            pump.remove(conn)
            if rank is not held:
                conn.close()
        if rank.commands is not None and rank is not held:
            rank.commands.close()
    pump.close()
    if held is not None and held.alive:
        return
    if lifeline is not None and not lifeline.closed:
        lifeline.close()
    end_host()
