"""Debugging a rank from JupyterLab: pdb's prompt in the cell's input box, typed into by a user.

A cell launches 2 ranks with ``nb_dist.breakpoint(rank=1)``. The test waits for JupyterLab's
stdin box (ipykernel's ``input_request``) with the ``[rank 1] (Pdb) `` prompt, types a pdb
command into it as a user would, checks pdb's answer in the cell's output, lets the rank go
on with ``c``, and checks that the launch finishes with every rank's result and leaves no
worker process behind. The screenshot ``debug_prompt.png`` shows the prompt with an answer.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import nbformat
import pytest
from lab_helpers import (
    LabServer,
    code_cell,
    kernel_ranks,
    open_notebook,
    output_text,
    screenshot,
    wait_for_no_ranks,
    wait_for_text,
)
from playwright.sync_api import Locator, Page

pytestmark = pytest.mark.browser

PROMPT = "[rank 1] (Pdb) "
# JupyterLab's input box for an input_request; once answered it is hidden, then removed.
LIVE_STDIN = ".jp-OutputArea-child:not(.jp-OutputArea-stdin-hiding) .jp-Stdin"
SETUP = """\
import nb_dist
import torch
import torch.distributed as dist"""
LAUNCH = """\
def inspect_rank():
    dist.init_process_group()
    rank = dist.get_rank()
    secret = {"rank": rank, "token": 7 * (rank + 6)}
    nb_dist.breakpoint(rank=1)  # rank 1 stops at the next line; rank 0 waits
    total = torch.tensor([secret["token"]])
    dist.all_reduce(total)
    return total.item()


result = nb_dist.notebook_launcher(inspect_rank, num_processes=2, timeout=120)
print("results:", list(result))"""


def write_debug_notebook(path: Path) -> None:
    """Two cells: imports, then a launch that stops rank 1 in pdb."""
    nb = nbformat.v4.new_notebook(
        metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
        },
        cells=[nbformat.v4.new_code_cell(source) for source in (SETUP, LAUNCH)],
    )
    nbformat.write(nb, path)


def run_cell(cell: Locator) -> None:
    """Select ``cell`` and run it with Shift+Enter, as a user would."""
    cell.locator(".jp-InputPrompt").click()
    cell.page.keyboard.press("Shift+Enter")


def wait_for_stdin(cell: Locator, prompt: str, within: float) -> Locator:
    """The cell's live stdin box (not one JupyterLab is hiding after an answer) with ``prompt``.

    Returns its text input, visible and empty, ready for typing.
    """
    live = cell.locator(LIVE_STDIN)
    deadline = time.monotonic() + within
    shown = ""
    while time.monotonic() < deadline:
        if live.count() == 1:
            shown = live.locator(".jp-Stdin-prompt").inner_text()
            box = live.locator("input.jp-Stdin-input")
            if shown.strip() == prompt.strip() and box.is_visible() and not box.input_value():
                return box
        time.sleep(0.1)
    raise AssertionError(
        f"no input box with the prompt {prompt!r} within {within} s (prompt shown: {shown!r}); "
        f"the cell's output:\n{output_text(cell)}"
    )


def answer(cell: Locator, command: str, within: float = 60) -> None:
    """Type ``command`` into the cell's pdb prompt and press Enter."""
    box = wait_for_stdin(cell, PROMPT, within)
    box.click()
    box.press_sequentially(command)
    box.press("Enter")


@pytest.mark.timeout(300)
def test_breakpoint_prompt_in_the_input_box(lab: LabServer, page: Page, screenshots_dir: Path):
    """pdb's prompt of rank 1 appears in JupyterLab's input box; typed commands are answered."""
    write_debug_notebook(lab.root_dir / "debug_rank.ipynb")
    open_notebook(page, lab, "debug_rank.ipynb")
    setup = code_cell(page, "import nb_dist")
    run_cell(setup)
    launch = code_cell(page, "def inspect_rank")
    outputs = launch.locator(".jp-OutputArea-output")

    run_cell(launch)
    wait_for_stdin(launch, PROMPT, within=120)
    text = output_text(launch)
    assert "rank 1 paused; c goes on, q stops the function" in text, text
    assert "nb_dist.breakpoint(rank=1)" in text, text  # pdb's listing around the line
    assert len(kernel_ranks(lab)) == 2, "both ranks should be alive while rank 1 is paused"

    answer(launch, "p secret")
    wait_for_text(outputs, "{'rank': 1, 'token': 49}", 60)
    wait_for_stdin(launch, PROMPT, within=60)  # pdb asks for the next command
    text = output_text(launch)
    assert re.search(r"\[rank 1\] \(Pdb\)\s+p secret\n", text), text  # the typed command
    assert "results:" not in text, "the launch went on while rank 1 was in pdb"
    screenshot(launch, screenshots_dir, "debug_prompt.png", margin=4)

    answer(launch, "c")
    text = wait_for_text(outputs, re.compile(r"results: \[91, 91\]"), 120)
    assert "Traceback" not in text and "Error" not in text, text
    assert not launch.locator(LIVE_STDIN).count(), "an input box is still open after the launch"
    wait_for_no_ranks(lab, within=10)
