"""The notebook harness catches regressions: nbval fails on a broken notebook, passes when fixed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BROKEN = Path(__file__).parent / "broken_notebooks" / "forgot_set_epoch.ipynb"
WRONG_PREDICTION = Path(__file__).parent / "broken_notebooks" / "wrong_prediction.ipynb"


def _nbval(notebook: Path) -> subprocess.CompletedProcess[str]:
    # A fresh pytest in the notebook's folder, without this project's addopts, exactly as the
    # README's test command runs the teaching notebooks (--nbval in the current environment).
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--override-ini=addopts=",
            "--nbval",
            "--nbval-current-env",
            str(notebook),
        ],
        cwd=notebook.parent,
        capture_output=True,
        text=True,
        timeout=150,
    )


@pytest.mark.timeout(180)
def test_nbval_fails_on_the_notebook_that_forgets_set_epoch(tmp_path):
    """The must-fail notebook fails, at the cell that checks the epoch orders."""
    notebook = tmp_path / BROKEN.name
    shutil.copy(BROKEN, notebook)
    run = _nbval(notebook)
    assert run.returncode != 0, run.stdout
    assert "1 failed" in run.stdout and "call set_epoch" in run.stdout, run.stdout


@pytest.mark.timeout(180)
def test_nbval_passes_once_set_epoch_is_called(tmp_path):
    """Positive control: the same notebook with SET_EPOCH = True passes."""
    notebook = tmp_path / BROKEN.name
    notebook.write_text(BROKEN.read_text().replace("SET_EPOCH = False", "SET_EPOCH = True"))
    run = _nbval(notebook)
    assert run.returncode == 0, run.stdout


@pytest.mark.timeout(180)
def test_nbval_fails_at_the_checking_cell_of_a_wrong_prediction(tmp_path):
    """A wrong exercise answer fails nbval at the checking cell, and the hint is shown."""
    notebook = tmp_path / WRONG_PREDICTION.name
    shutil.copy(WRONG_PREDICTION, notebook)
    run = _nbval(notebook)
    report = re.sub(r"\x1b\[[0-9;]*m", "", run.stdout)  # IPython colours the traceback
    assert run.returncode != 0, report
    assert "1 failed, 2 passed" in report, report
    failed_cell = report.split("Input:")[1].split("Traceback:")[0]
    assert "check(answer, truth" in failed_cell, report  # it is the checking cell that fails
    assert "AssertionError: not quite: you said [2, 5, 8, 0], the code gives [2, 5, 8, 1]. " in (
        report
    )
    assert "Hint: the sampler pads 10 indices to 12" in report, report


@pytest.mark.timeout(180)
def test_nbval_passes_with_the_right_prediction(tmp_path):
    """Positive control: with the right answer nbval passes, comparing its 'right:' output."""
    notebook = tmp_path / WRONG_PREDICTION.name
    notebook.write_text(
        WRONG_PREDICTION.read_text().replace("answer = [2, 5, 8, 0]", "answer = [2, 5, 8, 1]")
    )
    run = _nbval(notebook)
    assert run.returncode == 0, run.stdout
    assert "3 passed" in run.stdout, run.stdout


TEACHING = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("notebook", TEACHING, ids=lambda path: path.stem)
def test_compared_outputs_hold_no_terminal_colours(notebook):
    """Outputs nbval compares are plain text: colour codes change with releases (IPython 9.18
    recoloured pdb's listing), and students read stored outputs on GitHub and nbviewer too.
    Tracebacks (error outputs) are not compared and keep IPython's colours."""
    coloured = []
    for number, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        for output in cell.get("outputs", []):
            if output["output_type"] == "error":
                continue
            text = "".join(output.get("text", "")) + "".join(
                output.get("data", {}).get("text/plain", "")
            )
            if "\x1b[" in text:
                coloured.append(number)
    assert not coloured, f"{notebook.name}: cells {coloured} store terminal colour codes"
