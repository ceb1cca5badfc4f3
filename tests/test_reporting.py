"""``nb_dist.report`` and the worker-side helpers, proven with real launches.

What a rank reports reaches ``result.reports[name][rank]`` as ``(step, value)`` entries, in
order, copied at report time; rank helpers, ``main_process_first`` and ``progress`` behave in
a launch and outside one; ``GradientView`` and ``AllReduceStepper`` agree with real DDP and
real ``dist.all_reduce`` runs.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import nb_dist
from nb_dist import (
    AllReduceStepper,
    GradientView,
    ReportEntry,
    WorkerFailedError,
    notebook_launcher,
)
from nb_dist._shared import _reporting as reporting_module
from nb_dist.views import ring_allreduce_steps
from nb_dist.views._display import figure_png

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MANY = 20_000


# ----------------------------------------------------------------------------- worker functions
def _report_every_kind():
    r = nb_dist.rank()
    for i in range(3):
        nb_dist.report("loss", torch.tensor(10.0 * r + i))  # 0-d tensor, default steps 0, 1, 2
    vec = torch.arange(4.0) + r
    nb_dist.report("vec", vec)
    vec.add_(100.0)  # mutated right after reporting: the report must hold the old values
    mat = torch.full((2, 3), float(r), requires_grad=True) * 2
    nb_dist.report("mat", mat)
    with torch.no_grad():
        mat.zero_()
    nb_dist.report("nested", {"a": torch.tensor([1.0, 2.0]) * r, "b": [torch.tensor(3.0), 4]})
    nb_dist.report("explicit", 1.5, step=10)
    nb_dist.report("explicit", 2.5, step=20)
    nb_dist.report("explicit", 3.5)  # one more than the last step under this name: 21
    nb_dist.report("plain", 0.25 * r)
    return r


def _report_many(count):
    for i in range(count):
        nb_dist.report("i", i)
        nb_dist.report("twice", 2 * i)
    return count


def _report_for(seconds):
    count = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        nb_dist.report("i", count)
        count += 1
    return count


def _report_then_raise(folder: str):
    r = nb_dist.rank()
    for i in range(600):  # more than one batch
        nb_dist.report("loss", float(i + r))
    done = os.path.join(folder, "rank0-reported")
    if r == 0:
        open(done, "w").close()
        return r
    # Rank 1 fails only once rank 0 has reported all (a handshake: on a loaded machine rank 0
    # may not have started reporting when rank 1 gets here, and would be stopped mid-way).
    deadline = time.monotonic() + 60
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.01)
    raise ValueError("bad batch 7")


def _rank_helpers():
    return (
        nb_dist.rank(),
        nb_dist.local_rank(),
        nb_dist.world_size(),
        nb_dist.is_main_process(),
    )


def _main_process_first(folder):
    path = Path(folder, "prepared.txt")
    with nb_dist.main_process_first():
        entered = time.time()
        if nb_dist.is_main_process():
            time.sleep(0.4)
            path.write_text("ready")
            found = True
        else:
            found = path.exists() and path.read_text() == "ready"
        left = time.time()
    return found, entered, left


def _main_process_first_without_group():
    with nb_dist.main_process_first():
        return "inside"


def _progress_loop():
    total = 0
    for i in nb_dist.progress(range(50), desc="train"):
        total += i
    unsized = sum(nb_dist.progress((i for i in range(7)), desc="gen"))
    return total, unsized


def _refuse_unpickling():
    raise RuntimeError("this class cannot be rebuilt in the kernel")


class Unloadable:
    """Pickles in the worker, fails to unpickle in the kernel."""

    def __reduce__(self):
        return (_refuse_unpickling, ())


def _report_unloadable():
    nb_dist.report("before", 0.5)
    nb_dist.report("odd", Unloadable())  # in the same batch as the values around it
    nb_dist.report("after", 1.0)
    print("still running")
    return nb_dist.rank()


def _ddp_gradients():
    """Local gradients (no_sync), synced gradients, and 3 accumulation micro-steps + 1 sync."""
    dist.init_process_group("gloo")
    r = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ddp = DistributedDataParallel(model)
    data = torch.Generator().manual_seed(100 + r)  # different data per rank
    x, y = torch.randn(8, 4, generator=data), torch.randn(8, 3, generator=data)
    loss_fn = torch.nn.MSELoss()

    with ddp.no_sync():
        loss_fn(ddp(x), y).backward()
    nb_dist.report("grad/local", ddp.module.weight.grad)
    ddp.zero_grad()
    loss_fn(ddp(x), y).backward()
    nb_dist.report("grad/synced", ddp.module.weight.grad)

    # Gradient accumulation: 3 micro-steps under no_sync, the 4th synchronises.
    ddp.zero_grad()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for micro in range(4):
        xb, yb = torch.randn(8, 4, generator=data), torch.randn(8, 3, generator=data)
        if micro < 3:
            with ddp.no_sync():
                loss_fn(ddp(xb), yb).backward()
        else:
            loss_fn(ddp(xb), yb).backward()
        nb_dist.report("grad/accum", ddp.module.weight.grad, step=micro)
        nb_dist.report("weight", ddp.module.weight, step=micro)
    optimizer.step()
    nb_dist.report("weight", ddp.module.weight, step=4)
    return r


def _all_reduce_buffers():
    """Each rank's inputs and what ``dist.all_reduce`` (SUM) left on it."""
    r = dist.get_rank()
    small = torch.tensor([r + 1.0, r + 2.0, r + 3.0])
    rand = torch.rand(7, generator=torch.Generator().manual_seed(1234 + r))
    inputs = (small.clone(), rand.clone())
    dist.all_reduce(small)
    dist.all_reduce(rand)
    return inputs, (small, rand)


# ----------------------------------------------------------------------------- report → result
def test_reports_arrive_per_name_and_rank_as_copies():
    """Scalars, tensors, dicts/lists and explicit steps arrive per rank, in order, copied."""
    before = time.time()
    result = notebook_launcher(_report_every_kind, num_processes=2)
    after = time.time()
    assert list(result) == [0, 1]
    reports = result.reports
    assert sorted(reports) == ["explicit", "loss", "mat", "nested", "plain", "vec"]
    for rank in (0, 1):
        loss = reports["loss"][rank]
        assert [tuple(e) for e in loss] == [(i, 10.0 * rank + i) for i in range(3)]
        assert all(type(v) is float for _, v in loss), "0-d tensors arrive as Python floats"
        assert all(isinstance(e, ReportEntry) for e in loss)
        assert all(before <= e.time <= after for e in loss)
        assert [e.time for e in loss] == sorted(e.time for e in loss)
        assert loss[1].step == 1 and loss[1].value == 10.0 * rank + 1

        ((step, vec),) = reports["vec"][rank]
        assert step == 0
        assert isinstance(vec, torch.Tensor) and vec.device.type == "cpu"
        assert torch.equal(vec, torch.arange(4.0) + rank), "in-place change leaked into report"

        ((_, mat),) = reports["mat"][rank]
        assert mat.shape == (2, 3) and not mat.requires_grad
        assert torch.equal(mat, torch.full((2, 3), 2.0 * rank))

        ((_, nested),) = reports["nested"][rank]
        assert torch.equal(nested["a"], torch.tensor([1.0, 2.0]) * rank)
        assert nested["b"] == [3.0, 4] and type(nested["b"][0]) is float

        assert [tuple(e) for e in reports["explicit"][rank]] == [(10, 1.5), (20, 2.5), (21, 3.5)]
        assert [tuple(e) for e in reports["plain"][rank]] == [(0, 0.25 * rank)]

    assert reports.last("loss") == {0: 2.0, 1: 12.0}
    assert reports.last("never reported") == {}
    assert reports.series("loss", 1) == ([0, 1, 2], [10.0, 11.0, 12.0])
    assert reports.series("explicit", 0) == ([10, 20, 21], [1.5, 2.5, 3.5])
    assert reports.series("loss", 5) == ([], [])
    assert "'loss' (rank 0: 3, rank 1: 3)" in repr(reports)


@pytest.mark.timeout(60)
def test_many_reports_all_arrive_in_order_and_quickly():
    """20000 reports x 2 names per rank in a tight loop: none lost, in order, never waiting on
    the kernel (a report that waited for its poll, every 0.1 s, would take over an hour; the
    cost of one report is measured by bench/report_overhead.py)."""
    result = notebook_launcher(_report_many, (MANY,), num_processes=2)
    for rank in (0, 1):
        steps, values = result.reports.series("i", rank)
        assert steps == list(range(MANY))
        assert values == list(range(MANY))
        assert result.reports.series("twice", rank)[1] == [2 * i for i in range(MANY)]
        # The 40000 reports take 0.25 s on an idle 2-core box and 2 s on one loaded so much
        # that the kernel reading their batches is starved (the sends then wait for the pipe).
        # 5 s is a few times that; waiting for the kernel's 0.1 s poll would take 4000 s. What
        # one report costs a training step is measured by bench/report_overhead.py.
        assert result.durations[rank] < 5.0, result.durations


@pytest.mark.timeout(60)
def test_no_report_is_lost_while_the_flusher_thread_sends(monkeypatch):
    """Stress the flusher (every 0.5 ms) against a tight report loop: every entry arrives.

    The worker inherits the flush period through fork. A report appended to the buffer the
    flusher has just taken would be lost (the bug fixed in ``_Sink.add``).
    """
    monkeypatch.setattr(reporting_module, "_FLUSH_EVERY", 0.0005)
    original = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # inherited by the forked workers: many thread switches
    try:
        result = notebook_launcher(_report_for, (1.0,), num_processes=2)
    finally:
        sys.setswitchinterval(original)
    for rank in (0, 1):
        count = result[rank]
        assert count > 1000
        steps, values = result.reports.series("i", rank)
        assert len(steps) == count, f"rank {rank}: {count - len(steps)} reports lost"
        assert steps == list(range(count)) and values == list(range(count))


def test_reports_before_a_failure_are_on_the_error(tmp_path):
    """A rank that raises: what every rank reported before is on ``err.reports``."""
    with pytest.raises(WorkerFailedError) as caught:
        notebook_launcher(_report_then_raise, (str(tmp_path),), num_processes=2)
    err = caught.value
    assert str(err).startswith("rank 1 failed first: ValueError: bad batch 7")
    for rank in (0, 1):
        steps, values = err.reports.series("loss", rank)
        assert steps == list(range(600))
        assert values == [float(i + rank) for i in range(600)]


def test_an_object_the_kernel_cannot_unpickle_gives_a_notice(capsys):
    """An unloadable report is skipped with a notice naming the rank; the launch goes on."""
    result = notebook_launcher(_report_unloadable, num_processes=2)
    assert list(result) == [0, 1]
    err = capsys.readouterr().err
    for rank in (0, 1):
        # The one value the kernel cannot read is named, with its rank and type...
        assert (
            f"[nb_dist] report('odd', ...) from rank {rank}: the kernel cannot read a "
            "test_reporting.Unloadable (RuntimeError: this class cannot be rebuilt in the "
            "kernel)"
        ) in err
        # ... and costs only itself: the values reported with it in its batch arrive.
        assert result.reports.series("before", rank) == ([0], [0.5])
        assert result.reports.series("after", rank) == ([0], [1.0])
        assert "still running" in result.logs[rank]
    assert "objects of classes the kernel imports" in err
    assert "odd" not in result.reports


# ----------------------------------------------------------------------------- outside a launch
def test_report_outside_a_launch_keeps_values_locally():
    """In the calling process, report() stores values in local_reports() with steps 0, 1..."""
    name = f"outside-{os.getpid()}-{time.monotonic_ns()}"
    nb_dist.report(name, torch.tensor(2.0))
    vec = torch.ones(3)
    nb_dist.report(name, vec)
    vec.zero_()
    nb_dist.report(name, 7, step=10)
    nb_dist.report(name, 8)
    entries = nb_dist.local_reports()[name][0]
    assert [e.step for e in entries] == [0, 1, 10, 11]
    assert entries[0].value == 2.0 and type(entries[0].value) is float
    assert torch.equal(entries[1].value, torch.ones(3))
    assert nb_dist.local_reports().last(name) == {0: 8}


@pytest.mark.parametrize(
    ("args", "kwargs", "names"),
    [
        ((3, 1.0), {}, ("name=3", "name must be a non-empty string")),
        (("", 1.0), {}, ("name=''", "name must be a non-empty string")),
        ((None, 1.0), {}, ("name=None", "name must be a non-empty string")),
        (("loss", 1.0), {"step": 1.5}, ("step=1.5", "step must be an int or None")),
        (("loss", 1.0), {"step": "3"}, ("step='3'", "step must be an int or None")),
        (("loss", 1.0), {"step": True}, ("step=True", "step must be an int or None")),
    ],
)
def test_report_refuses_bad_arguments(args, kwargs, names):
    """A bad name or step raises TypeError naming the parameter and its value."""
    with pytest.raises(TypeError) as caught:
        nb_dist.report(*args, **kwargs)
    for text in names:
        assert text in str(caught.value)


# ----------------------------------------------------------------------------- rank helpers
def test_rank_helpers_in_a_launch_and_outside():
    """rank/local_rank/world_size/is_main_process from the env in workers; 0, 0, 1, True here."""
    result = notebook_launcher(_rank_helpers, num_processes=2)
    assert list(result) == [(0, 0, 2, True), (1, 1, 2, False)]
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        assert var not in os.environ
    assert _rank_helpers() == (0, 0, 1, True)


def test_main_process_first_runs_rank0_block_before_the_others(tmp_path):
    """Rank 1 enters its block only after rank 0 left its own, and finds rank 0's file."""
    result = notebook_launcher(
        _main_process_first, (str(tmp_path),), num_processes=2, init_process_group=True
    )
    (found0, _entered0, left0), (found1, entered1, _left1) = result
    assert found0 and found1, "rank 1 did not find the file rank 0 wrote first"
    assert entered1 >= left0


def test_main_process_first_outside_a_launch_is_a_no_op():
    """Outside a launch there is nobody to wait for: the block just runs."""
    assert not dist.is_initialized()
    assert _main_process_first_without_group() == "inside"


def test_main_process_first_without_a_process_group_says_how_to_fix():
    """In a launch without the default process group it raises and names both fixes."""
    with pytest.raises(WorkerFailedError) as caught:
        notebook_launcher(_main_process_first_without_group, num_processes=2)
    message = str(caught.value)
    assert re.match(r"rank [01] failed first: RuntimeError: main_process_first\(\)", message)
    assert "needs the default process group" in message
    assert "torch.distributed.init_process_group()" in message
    assert "init_process_group=True" in message


# ----------------------------------------------------------------------------- progress
def test_progress_prints_one_line_per_rank(capsys):
    """progress() in a launch: one 'train: 50/50 done in ...' line per rank, not 50."""
    result = notebook_launcher(_progress_loop, num_processes=2)
    assert list(result) == [(1225, 21), (1225, 21)]
    out = capsys.readouterr().out
    for rank in (0, 1):
        train = [line for line in out.splitlines() if line.startswith(f"[rank {rank}] train")]
        assert len(train) == 1, out
        assert re.fullmatch(rf"\[rank {rank}\] train: 50/50 done in \d+\.\d s", train[0])
        gen = [line for line in out.splitlines() if line.startswith(f"[rank {rank}] gen")]
        assert len(gen) == 1 and re.fullmatch(rf"\[rank {rank}\] gen: 7 done in \d+\.\d s", gen[0])
    assert len(out.splitlines()) == 4, out


def test_progress_outside_a_launch_is_a_plain_loop(capsys):
    """Outside a launch progress() yields every item and prints nothing."""
    assert list(nb_dist.progress(range(50), desc="train")) == list(range(50))
    assert list(nb_dist.progress(iter("abc"))) == ["a", "b", "c"]
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


# ----------------------------------------------------------------------------- GradientView
@pytest.fixture(scope="module")
def ddp_reports():
    """Reports of one real 2-rank DDP run (see ``_ddp_gradients``)."""
    result = notebook_launcher(_ddp_gradients, num_processes=2)
    assert list(result) == [0, 1]
    return result.reports


@pytest.mark.timeout(60)
def test_gradient_view_of_a_real_ddp_run(ddp_reports):
    """Local gradients differ across ranks; DDP's synced ones agree and equal their mean."""
    view = GradientView(ddp_reports)
    local = view.local()
    assert sorted(local) == [0, 1] and local[0].shape == (3, 4)
    assert view.spread_before() > 1e-3
    assert view.spread_after() < 1e-6
    assert view.mean_error() < 1e-6
    mean = (local[0] + local[1]) / 2
    assert torch.allclose(view.synced()[0], mean, atol=1e-6)

    summary = view.summary()
    assert summary.startswith("GradientView('grad/local' -> 'grad/synced', last step)")
    assert f"max difference across ranks before sync: {view.spread_before():.3g}" in summary
    assert f"max difference across ranks after sync:  {view.spread_after():.3g}" in summary
    assert f"synced gradient vs mean of local ones:   {view.mean_error():.3g}" in summary
    for rank in (0, 1):
        norm = float(local[rank].norm())
        assert f"rank {rank}: local gradient norm {norm:.4g}" in summary
    assert repr(view) == summary
    assert figure_png(view.figure()).startswith(PNG_MAGIC)


@pytest.mark.timeout(60)
def test_divergence_grows_under_no_sync_and_vanishes_on_the_sync_step(ddp_reports):
    """Accumulated grads differ on no_sync micro-steps and agree after the synchronising one."""
    view = GradientView(ddp_reports)
    divergence = dict(view.divergence("grad/accum"))
    assert sorted(divergence) == [0, 1, 2, 3]
    for micro in (0, 1, 2):
        assert divergence[micro] > 1e-3, divergence
    assert divergence[3] < 1e-6, divergence
    # The weights never diverge: only synced gradients are ever applied.
    weights = dict(view.divergence("weight"))
    assert sorted(weights) == [0, 1, 2, 3, 4]
    assert max(weights.values()) < 1e-7, weights
    w = ddp_reports["weight"]
    assert not torch.equal(w[0][0].value, w[0][-1].value), "the optimizer step did not happen"
    assert figure_png(view.divergence_figure("grad/accum", sync_every=4)).startswith(PNG_MAGIC)


def test_gradient_view_unknown_names_list_the_known_ones(ddp_reports):
    """An unknown report name raises KeyError naming it and every reported name."""
    with pytest.raises(KeyError) as caught:
        GradientView(ddp_reports, local="grad/nope")
    message = caught.value.args[0]
    assert "no reports named 'grad/nope'" in message
    assert "'grad/accum', 'grad/local', 'grad/synced', 'weight'" in message
    assert "nb_dist.report('grad/nope', grad)" in message

    with pytest.raises(KeyError) as caught:
        GradientView(ddp_reports).divergence("grad/missing")
    message = caught.value.args[0]
    assert "no reports named 'grad/missing'" in message
    assert "'grad/accum', 'grad/local', 'grad/synced', 'weight'" in message


# ----------------------------------------------------------------------------- AllReduceStepper
@pytest.mark.timeout(60)
def test_allreduce_stepper_matches_real_all_reduce_on_4_ranks():
    """The simulated ring's final buffers equal gloo's all_reduce (and /4 for op='avg')."""
    result = notebook_launcher(_all_reduce_buffers, num_processes=4, init_process_group=True)
    inputs = [ins for ins, _ in result]
    outputs = [outs for _, outs in result]
    for r in range(4):
        assert inputs[r][0].tolist() == [r + 1.0, r + 2.0, r + 3.0]
    assert all(outs[0].tolist() == [10.0, 14.0, 18.0] for outs in outputs)

    for which in (0, 1):
        buffers = [ins[which] for ins in inputs]
        summed = ring_allreduce_steps(buffers)[-1].buffers
        averaged = ring_allreduce_steps(buffers, op="avg")[-1].buffers
        stepper = AllReduceStepper(buffers, op="avg")
        at_end = stepper.go_to(stepper.num_steps).buffers()
        for r in range(4):
            real = outputs[r][which].tolist()
            assert len(summed[r]) == len(real) == (3 if which == 0 else 7)
            for sim, sim_avg, stepped, got in zip(
                summed[r], averaged[r], at_end[r], real, strict=True
            ):
                assert math.isclose(sim, got, rel_tol=0, abs_tol=1e-6), (r, summed[r], real)
                assert math.isclose(sim_avg, got / 4, rel_tol=0, abs_tol=1e-6)
                assert math.isclose(stepped, got / 4, rel_tol=0, abs_tol=1e-6)


def test_reports_keep_ranks_in_rank_order_whoever_reports_first():
    """reports[name] lists ranks 0, 1, 2 even when rank 2 reported first (stable printouts)."""
    reports = reporting_module.Reports()
    for rank in (2, 0, 1, 0):
        reports.add(rank, "loss", step=rank, when=0.0, value=float(rank))
    assert list(reports["loss"]) == [0, 1, 2]
    assert [len(v) for v in reports["loss"].values()] == [2, 1, 1]
    assert reports.last("loss") == {0: 0.0, 1: 1.0, 2: 2.0}


def _reports_after_returning():
    import threading

    def keep_reporting():
        step = 0
        while True:
            nb_dist.report("late", step)
            step += 1

    threading.Thread(target=keep_reporting, daemon=True).start()
    return bytes(range(256)) * 20_000  # 5 MB: written raw after its size, in many writes


@pytest.mark.timeout(60)
def test_reports_from_a_thread_after_return_do_not_corrupt_the_value():
    result = notebook_launcher(_reports_after_returning, num_processes=2)
    assert [len(v) for v in result] == [5_120_000, 5_120_000]
    assert all(v == bytes(range(256)) * 20_000 for v in result)
