"""The notebooks, the teaching widgets and the live monitor, rendered by a real JupyterLab.

Each test opens a notebook in Chromium (see ``conftest.py``), runs it through JupyterLab's own
UI, and asserts on the text and elements the browser rendered: rank-labelled launch output,
results, widgets that really displayed (no "Error displaying widget", no "Loading widget..."
left), controls that change their view when used, and the monitor and toolbar interrupt of a
live launch. Screenshots of the key cells are saved as artifacts, never compared.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import nbformat
import pytest
from lab_helpers import (
    NOTEBOOKS,
    RENDERED_WIDGET,
    LabServer,
    assert_not_upscaled,
    cells_expected_to_raise,
    cells_with_tracebacks,
    code_cell,
    code_cells,
    error_outputs,
    kernel_ranks,
    open_notebook,
    output_text,
    run_all_cells,
    screenshot,
    stored_widget_cells,
    toolbar_button,
    wait_for_no_ranks,
    wait_for_text,
    wait_for_widget,
    wait_until_all_executed,
)
from playwright.sync_api import Locator, Page

pytestmark = pytest.mark.browser

RUN_ALL_WITHIN = 200  # seconds for a whole teaching notebook on a loaded 2-core machine
WIDGET_WITHIN = 30  # seconds for a widget to render once its cell ran
VIEW_UPDATE_WITHIN = 30  # seconds for a view to follow one of its controls


def assert_no_widget_failures(page: Page) -> None:
    """No widget anywhere in the notebook shows an error or is still loading."""
    notebook = page.locator(".jp-NotebookPanel-notebook")
    text = notebook.inner_text()
    assert "Error displaying widget" not in text
    assert "Loading widget..." not in text


# --------------------------------------------------------------------------- 1. quickstart
@pytest.mark.timeout(300)
def test_quickstart_runs_and_shows_every_rank(lab: LabServer, page: Page, screenshots_dir: Path):
    """Run All on the quickstart renders every rank's labelled lines and the per-rank results."""
    open_notebook(page, lab, "00_quickstart.ipynb")
    run_all_cells(page)
    wait_until_all_executed(page, within=RUN_ALL_WITHIN)
    assert cells_with_tracebacks(page) == [], error_outputs(page)

    launch = code_cell(page, "result = notebook_launcher(hello")
    text = output_text(launch)
    for rank in (0, 1):
        assert f"[rank {rank}] hello from rank {rank} of 2 (RANK={rank})" in text, text
        assert f"[rank {rank}] sum over ranks: 3.0" in text, text

    results = code_cell(page, "print(result.by_rank)")
    text = output_text(results)
    assert "{'rank': 0, 'value': 30.0}\n{'rank': 1, 'value': 30.0}" in text, text
    assert "{0: {'rank': 0, 'value': 30.0}, 1: {'rank': 1, 'value': 30.0}}" in text, text
    assert "LaunchResult([{'rank': 0, 'value': 30.0}, {'rank': 1, 'value': 30.0}])" in text, text

    outcomes = output_text(code_cell(page, "for outcome in result.outcomes"))
    assert "rank 0: status=ok, exit code 0\nrank 1: status=ok, exit code 0" in outcomes

    # The quickstart's monitored launch: the dashboard rendered and ended with both ranks done.
    watched = code_cell(page, "monitored = notebook_launcher(watched")
    monitor = wait_for_widget(watched, within=WIDGET_WITHIN)
    assert "nb-dist-monitor" in monitor.get_attribute("class")
    for rank in (0, 1):
        row = monitor.locator(f".nb-dist-monitor-rank-{rank}.nb-dist-status-done")
        wait_for_text(row, re.compile(r"done · [\d.]+ s · extra steps 5/5"), WIDGET_WITHIN)
    assert_no_widget_failures(page)
    screenshot(launch, screenshots_dir, "quickstart_launch.png", margin=4)
    screenshot(watched, screenshots_dir, "quickstart_monitor.png", margin=4)


# --------------------------------------------------------------------------- 2. widgets
def move_shard_explorer_epoch(page: Page, screenshots_dir: Path) -> None:
    """Keyboard on the epoch slider's handle: the explorer redraws for the next epoch."""
    view = page.locator(".nb-dist-shard-explorer")
    output = view.locator(".nb-dist-shard-explorer-output")
    readout = view.locator(".nb-dist-shard-explorer-epoch .widget-readout")
    # The notebook's last cell set epoch=1 and set_epoch=False from the kernel.
    before = output.inner_text()
    assert "epoch 1, batches of 2" in before, before
    assert "set_epoch is not called" in before, before
    assert readout.inner_text() == "1"
    screenshot(view, screenshots_dir, "shard_explorer.png")
    handle = view.locator(".nb-dist-shard-explorer-epoch .noUi-handle")
    handle.focus()
    handle.press("ArrowRight")
    after = wait_for_text(output, "epoch 2, batches of 2", VIEW_UPDATE_WITHIN)
    assert "epoch 3" in after and after != before, after
    assert readout.inner_text() == "2"


def step_allreduce_and_gradients(page: Page, screenshots_dir: Path) -> None:
    """Reset and Step move the ring; the gradient view's step slider swaps the plot."""
    stepper = page.locator(".nb-dist-allreduce-stepper")
    output = stepper.locator(".nb-dist-allreduce-stepper-output")
    # The notebook's cells called go_to(3), then go_to(num_steps): the view shows the last.
    wait_for_text(output, "step 6/6: all-gather 3/3", VIEW_UPDATE_WITHIN)
    readout = stepper.locator(".nb-dist-allreduce-stepper-step .widget-readout")
    assert readout.inner_text() == "6"
    screenshot(stepper, screenshots_dir, "allreduce_stepper.png")
    stepper.locator("button.nb-dist-allreduce-stepper-reset").click()
    wait_for_text(output, "step 0/6: initial buffers", VIEW_UPDATE_WITHIN)
    stepper.locator("button.nb-dist-allreduce-stepper-next").click()
    wait_for_text(output, "step 1/6: reduce-scatter 1/3", VIEW_UPDATE_WITHIN)
    assert readout.inner_text() == "1"

    gradients = page.locator(".nb-dist-gradient-view")
    image = gradients.locator("img.nb-dist-gradient-view-output")
    assert_not_upscaled(image)
    screenshot(gradients, screenshots_dir, "gradient_view.png")
    src = image.get_attribute("src")
    readout = gradients.locator(".nb-dist-gradient-view-step .widget-readout")
    assert readout.inner_text() == "2"  # the last of steps 0, 1, 2
    handle = gradients.locator(".nb-dist-gradient-view-step .noUi-handle")
    handle.focus()
    handle.press("Home")
    wait_for_text(gradients, "GradientView('grad/local' -> 'grad/synced', step 0)", 30)
    assert readout.inner_text() == "0"
    assert image.get_attribute("src") != src, "the gradient plot did not change"


def change_precision_value(page: Page, screenshots_dir: Path) -> None:
    """Typing a new value in the explorer's text box re-renders the table for that value."""
    view = page.locator(".nb-dist-precision-explorer")
    output = view.locator(".nb-dist-precision-explorer-output")
    before = output.inner_text()
    assert "65000" in before, before
    screenshot(view, screenshots_dir, "precision_explorer.png")
    box = view.locator(".nb-dist-precision-explorer-value input")
    box.fill("70000")
    box.press("Enter")
    after = wait_for_text(output, "70000", VIEW_UPDATE_WITHIN)
    assert after != before


def move_pipeline_microbatches(page: Page, screenshots_dir: Path) -> None:
    """One more microbatch on the AFAB timeline's slider: the bubble (p-1)/m shrinks."""
    view = page.locator(".widget-vbox").filter(has_text="m (microbatches)").first
    html = view.locator(".widget-html")
    before = wait_for_text(html, "bubble (idle / compute): 0.375", VIEW_UPDATE_WITHIN)
    screenshot(view, screenshots_dir, "pipeline_timeline.png")
    slider = view.locator(".widget-slider").filter(has_text="m (microbatches)")
    handle = slider.locator(".noUi-handle")
    handle.focus()
    handle.press("ArrowRight")  # m = 8 -> 9 on p = 4 stages: 3/9
    after = wait_for_text(html, "bubble (idle / compute): 0.333", VIEW_UPDATE_WITHIN)
    assert after != before


def move_memory_explorer_batch(page: Page, screenshots_dir: Path) -> None:
    """One more sequence per batch on the memory explorer: DP's activations grow by 1/8."""
    view = page.locator(".nb-dist-memory-explorer")
    output = view.locator(".nb-dist-memory-explorer-output")
    dp = output.locator('tr[data-strategy="DP"]')
    before = wait_for_text(output, "b=8, s=32", VIEW_UPDATE_WITHIN)
    assert "2.367" in dp.inner_text(), dp.inner_text()  # activations, MB: 4·L·(16bsh + ...)
    screenshot(view, screenshots_dir, "memory_explorer.png")
    handle = view.locator(".nb-dist-memory-explorer-b .noUi-handle")
    handle.focus()
    handle.press("ArrowRight")  # b = 8 -> 9
    after = wait_for_text(output, "b=9, s=32", VIEW_UPDATE_WITHIN)
    assert "2.663" in dp.inner_text(), dp.inner_text()  # 9/8 of the activations
    assert view.locator(".nb-dist-memory-explorer-b .widget-readout").inner_text() == "9"
    assert after != before


def switch_tensor_parallel_mode(page: Page, screenshots_dir: Path) -> None:
    """TP + SP instead of TP: f and g's all-reduces become all-gathers and reduce-scatters."""
    view = page.locator(".nb-dist-tensor-parallel-view")
    output = view.locator(".nb-dist-tensor-parallel-view-output")
    before = wait_for_text(output, "262144 bytes sent per rank and step", VIEW_UPDATE_WITHIN)
    assert "reduce-scatter" not in before, before
    screenshot(view, screenshots_dir, "tensor_parallel_view.png")
    view.locator(".nb-dist-tensor-parallel-view-mode button").filter(has_text="TP + SP").click()
    after = wait_for_text(output, "329216 bytes sent per rank and step", VIEW_UPDATE_WITHIN)
    assert "reduce-scatter" in after and "all-gather" in after, after


def step_online_softmax(page: Page, screenshots_dir: Path) -> None:
    """One block further on the online softmax: the next block's row and running state appear."""
    view = page.locator(".nb-dist-online-softmax-view")
    output = view.locator(".nb-dist-online-softmax-view-output")
    readout = view.locator(".nb-dist-online-softmax-view-step .widget-readout")
    before = wait_for_text(output, "3 block(s) to go", VIEW_UPDATE_WITHIN)
    assert "block 1 (keys 16-31)" not in before, before
    assert readout.inner_text() == "1"
    screenshot(view, screenshots_dir, "online_softmax_view.png")
    handle = view.locator(".nb-dist-online-softmax-view-step .noUi-handle")
    handle.focus()
    handle.press("ArrowRight")  # 1 -> 2 blocks seen
    after = wait_for_text(output, "block 1 (keys 16-31)", VIEW_UPDATE_WITHIN)
    assert "2 block(s) to go" in after, after
    assert readout.inner_text() == "2"


INTERACTIONS: dict[str, Callable[[Page, Path], None]] = {
    "02_sharding.ipynb": move_shard_explorer_epoch,
    "03_allreduce_and_gradients.ipynb": step_allreduce_and_gradients,
    "05_mixed_precision.ipynb": change_precision_value,
    "13_memory_of_a_training_step.ipynb": move_memory_explorer_batch,
    "16_tensor_parallelism.ipynb": switch_tensor_parallel_mode,
    "17_pipeline_parallelism.ipynb": move_pipeline_microbatches,
    "18_context_parallelism.ipynb": step_online_softmax,
}


# Notebooks with widgets that a test of their own runs and checks (their widgets included).
OWN_TESTS = {"00_quickstart.ipynb"}


def test_every_notebook_with_widgets_is_covered():
    """The widget test covers every teaching notebook whose stored outputs contain a widget."""
    with_widgets = {
        path.name for path in sorted(NOTEBOOKS.glob("*.ipynb")) if stored_widget_cells(path)
    }
    assert with_widgets >= OWN_TESTS, f"{OWN_TESTS - with_widgets} no longer show a widget"
    assert with_widgets - OWN_TESTS == set(INTERACTIONS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("notebook", sorted(INTERACTIONS))
def test_widgets_render_and_respond(
    lab: LabServer, page: Page, screenshots_dir: Path, notebook: str
):
    """Every widget output renders after Run All, and using one control changes its view."""
    expected = stored_widget_cells(NOTEBOOKS / notebook)
    assert expected, f"{notebook} has no widget outputs stored"
    open_notebook(page, lab, notebook)
    run_all_cells(page)
    wait_until_all_executed(page, within=RUN_ALL_WITHIN)

    raising = cells_with_tracebacks(page)
    assert raising == cells_expected_to_raise(NOTEBOOKS / notebook), error_outputs(page)
    cells = code_cells(page)
    for index in expected:
        wait_for_widget(cells.nth(index), within=WIDGET_WITHIN)
    shown = page.locator(f".jp-NotebookPanel-notebook {RENDERED_WIDGET}")
    assert shown.count() == len(expected), f"{shown.count()} widget outputs, {expected=}"
    assert_no_widget_failures(page)
    INTERACTIONS[notebook](page, screenshots_dir)
    assert_no_widget_failures(page)


# --------------------------------------------------------------------------- 3. monitor
MONITOR_STEPS = 800  # 0.05 s each: ~40 s, far longer than the test needs before ■
MONITOR_SETUP = """\
import math
import time

import nb_dist
from nb_dist import notebook_launcher


def train(steps):
    rank = nb_dist.rank()
    print(f"rank {rank} training")
    for step in nb_dist.progress(range(steps), desc="training"):
        nb_dist.report("loss", math.exp(-step / 150) + 0.1 * rank, step=step)
        time.sleep(0.05)


def quick():
    print("quick launch on rank", nb_dist.rank())
    return nb_dist.rank() * 10
"""
MONITOR_LAUNCH = f"notebook_launcher(train, args=({MONITOR_STEPS},), num_processes=2, monitor=True)"
AFTER_LAUNCH = """\
after = notebook_launcher(quick, num_processes=2)
print("after the interrupt:", list(after))"""


def write_monitor_notebook(path: Path) -> None:
    """The live-monitor notebook: definitions, a ~40 s monitored launch, a quick launch."""
    nb = nbformat.v4.new_notebook(
        metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
        },
        cells=[
            nbformat.v4.new_code_cell(source)
            for source in (MONITOR_SETUP, MONITOR_LAUNCH, AFTER_LAUNCH)
        ],
    )
    nbformat.write(nb, path)


def wait_for_progress(row: Locator, at_least: int, within: float) -> None:
    """Wait until a monitor row shows ``running ... training N/total`` with N >= ``at_least``."""
    pattern = re.compile(rf"running · [\d.]+ s · training (\d+)/{MONITOR_STEPS}")
    deadline = time.monotonic() + within
    text = ""
    while time.monotonic() < deadline:
        text = row.inner_text()
        match = pattern.search(text)
        if match and int(match.group(1)) >= at_least:
            return
        time.sleep(0.2)
    raise AssertionError(f"no 'training {at_least}+/{MONITOR_STEPS}' within {within} s: {text!r}")


@pytest.mark.timeout(300)
def test_monitor_and_toolbar_interrupt(lab: LabServer, page: Page, screenshots_dir: Path):
    """The monitor shows both ranks running; the toolbar's ■ stops them; the next launch works."""
    write_monitor_notebook(lab.root_dir / "live_monitor.ipynb")
    open_notebook(page, lab, "live_monitor.ipynb")
    run_all_cells(page)  # the third cell waits in the queue behind the long launch

    launch = code_cell(page, "notebook_launcher(train")
    monitor = wait_for_widget(launch, within=120)
    assert "nb-dist-monitor" in monitor.get_attribute("class")
    rows = [monitor.locator(f".nb-dist-monitor-rank-{rank}") for rank in (0, 1)]
    for rank, row in enumerate(rows):
        row.and_(page.locator(".nb-dist-status-running")).wait_for(timeout=60_000)
        wait_for_progress(row, at_least=MONITOR_STEPS // 5, within=60)
        wait_for_text(row, f"rank {rank} training", 30)
    plot = monitor.locator("img.nb-dist-monitor-plot")
    plot.wait_for(state="visible", timeout=30_000)
    assert_not_upscaled(plot)
    screenshot(monitor, screenshots_dir, "live_monitor.png")
    assert len(kernel_ranks(lab)) == 2

    interrupt = toolbar_button(page, "notebook:interrupt-kernel")
    assert interrupt.get_attribute("title") == "Interrupt the kernel"
    interrupt.click()

    # The cell ends with KeyboardInterrupt and what the launcher did (its last line).
    ends_interrupted = re.compile(
        r"\nKeyboardInterrupt: the launch was interrupted; all 2 ranks were stopped\s*$"
    )
    text = wait_for_text(launch.locator(".jp-OutputArea-output"), ends_interrupted, 60)
    assert "done in" not in text, f"the launch ended by itself before the interrupt:\n{text}"
    for row in rows:
        row.and_(page.locator(".nb-dist-status-stopped")).wait_for(timeout=30_000)
        wait_for_text(row, re.compile(r"stopped · [\d.]+ s"), 10)
    wait_for_no_ranks(lab, within=10)
    screenshot(launch, screenshots_dir, "monitor_interrupted.png", margin=4)

    after = code_cell(page, "after = notebook_launcher(quick")
    assert output_text(after) == "", "the queued cell ran although the interrupt cleared the queue"
    after.locator(".jp-InputPrompt").click()
    toolbar_button(page, "notebook:run-cell-and-select-next").click()
    text = wait_for_text(after.locator(".jp-OutputArea-output"), "after the interrupt: [0, 10]", 60)
    assert "[rank 0] quick launch on rank 0" in text and "[rank 1] quick launch on rank 1" in text
    assert "Error" not in text and "Traceback" not in text, text


# --------------------------------------------------------------------------- 4. live ranks
LIVE_RANKS = "04_ddp_step_by_step.ipynb"


@pytest.mark.timeout(300)
def test_live_ranks_step_by_step(lab: LabServer, page: Page, screenshots_dir: Path):
    """Run All on the live-ranks notebook: %%ranks cells show each rank's labelled lines and
    values, the figures drawn from pulled gradients render, the cell where one rank skips a
    collective ends in the deadlock report, and the next cell runs on the same ranks."""
    open_notebook(page, lab, LIVE_RANKS)
    run_all_cells(page)
    wait_until_all_executed(page, within=RUN_ALL_WITHIN)
    raising = cells_with_tracebacks(page)
    assert raising == cells_expected_to_raise(NOTEBOOKS / LIVE_RANKS), error_outputs(page)

    # A %%ranks cell: each rank's printed line, labelled, and each rank's value like Out[n].
    hello = code_cell(page, 'print(f"I am rank {rank} of {world_size}")')
    text = output_text(hello)
    for rank in (0, 1):
        assert f"[rank {rank}] I am rank {rank} of 2" in text, text
    assert re.search(r"\[rank 0\] 0\s*\n\s*\[rank 1\] 1", text), text

    # Per-rank values that differ (one line per rank), then agree ([all ranks], once).
    seeded = output_text(code_cell(page, "model = nn.Linear(4, 1)"))
    assert re.search(r"\[rank 0\] tensor\(\[\[-0\.0037,\s+0\.2682", seeded), seeded
    assert re.search(r"\[rank 1\] tensor\(\[\[ ?0\.2576,\s+-0\.2207", seeded), seeded
    broadcast = output_text(code_cell(page, "dist.broadcast(parameter, src=0)"))
    assert re.search(r"^\[all ranks\] tensor\(\[\[-0\.0037,", broadcast, re.M), broadcast
    assert "[rank" not in broadcast, broadcast
    shards = output_text(code_cell(page, "indices = list(sampler)"))
    assert "[rank 0] [0, 2, 4, 6, 8, 10, 12, 14]" in shards, shards
    assert "[rank 1] [1, 3, 5, 7, 9, 11, 13, 15]" in shards, shards

    # The figures drawn from pulled gradients.
    for snippet in ('local = ranks.pull("local_grad")', 'synced = ranks.pull("synced_grad")',
                    'pulled = ranks.pull("ddp_start", "ddp_grad")'):  # fmt: skip
        cell = code_cell(page, snippet)
        image = cell.locator(".jp-OutputArea-output img").first
        image.wait_for(state="visible", timeout=WIDGET_WITHIN * 1000)
        assert_not_upscaled(image)
    assert "equal to the hand-averaged gradient: True" in output_text(
        code_cell(page, 'pulled = ranks.pull("ddp_start", "ddp_grad")')
    )
    assert_no_widget_failures(page)

    # The skipped collective: no timeout, the counts prove the deadlock (the cell catches the
    # error, the next one prints its report); the state is kept.
    skipped = code_cell(page, "only rank 0 averages the loss")
    text = output_text(skipped)
    assert "[rank 1] finished the cell" in text, text
    assert "caught WorkerFailedError" in text, text
    report = code_cell(page, "lines = str(failure).splitlines()")
    text = output_text(report)
    assert "rank 0 is blocked in all_reduce #5, which rank 1 will never enter" in text, text
    assert "rank 0 waits in all_reduce #5 at `dist.all_reduce(logged_loss)`" in text, text
    assert "rank 1 finished the cell having entered 4 collectives" in text, text
    assert "Every rank kept its variables" in text, text
    screenshot(report, screenshots_dir, "live_ranks_timeout.png", margin=4)

    # The next cell runs on the same ranks, whose state was kept.
    after = output_text(code_cell(page, 'print("model" in globals(), "seed" in globals())'))
    assert "[rank 0] True True" in after and "[rank 1] True True" in after, after
    assert "[all ranks] 2" in after, after
    assert "restarts: 0" in output_text(code_cell(page, 'print("restarts:", ranks.restarts)'))

    # The exported script ran under torchrun and ended with the session's weights.
    trained = output_text(code_cell(page, "for epoch in range(3):"))
    weights = re.search(r"\[all ranks\] (tensor\(.*\))", trained)
    assert weights, trained
    ran = output_text(code_cell(page, "run = subprocess.run("))
    assert "exit code: 0" in ran and f"[rank 0] {weights.group(1)}" in ran, ran
    screenshot(hello, screenshots_dir, "live_ranks_cell.png", margin=4)
