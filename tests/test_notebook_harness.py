"""The notebook harness catches regressions: nbval fails on a broken notebook, passes when fixed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BROKEN = Path(__file__).parent / "broken_notebooks" / "forgot_set_epoch.ipynb"


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
