"""Every exercise of the teaching notebooks, both ways, in a real kernel.

The student edition of each notebook runs cell by cell. At each exercise its check runs at least
three times: after the blank (it must say "not answered yet" and not stop), after each wrong answer
(it must fail), and after the key (it must say "right"); the notebook then goes on with the
key, as the solutions edition does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kernel_helpers import Execution, execute

from nb_dist.teach import NOT_ANSWERED
from nb_dist.teach._editions import Exercise, exercises

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
WITH_EXERCISES = [
    path
    for path in sorted(NOTEBOOKS.glob("*.ipynb"))
    if exercises(json.loads(path.read_text()), path.name)
]
CELL_TIMEOUT = 170  # nbval's per-cell limit in pyproject.toml


def _source(cell: dict) -> str:
    source = cell["source"]
    return "".join(source) if isinstance(source, list) else source


def _run(kc, code: str, where: str) -> Execution:
    run = execute(kc, code, timeout=CELL_TIMEOUT)
    assert run.reply is not None, where
    return run


def _walk_exercise(kc, exercise: Exercise, check: str) -> None:
    where = f"{exercise.notebook} exercise {exercise.id}"
    _run(kc, exercise.blank, where).expect_ok()
    blank = _run(kc, check, where)
    assert blank.error is None, f"{where}: the check stopped on a blank\n{blank.error_text()}"
    assert NOT_ANSWERED in blank.stdout(), f"{where}: blank: {blank.stdout()!r}"
    for number, variant in enumerate(exercise.wrongs, 1):
        _run(kc, variant, where).expect_ok()
        wrong = _run(kc, check, where)
        assert wrong.error is not None, f"{where}: wrong answer {number} passed: {wrong.stdout()!r}"
        assert "right:" not in wrong.stdout(), f"{where}: wrong answer {number}"
    _run(kc, exercise.key, where).expect_ok()


@pytest.mark.kernel
@pytest.mark.timeout(900)
@pytest.mark.parametrize("notebook", WITH_EXERCISES, ids=lambda p: p.stem)
def test_every_exercise_fails_when_wrong_passes_with_the_key(notebook, kernels, tmp_path):
    # The kernel runs in tmp_path; a notebook finds the repository's files from its folder
    # (notebook 10 reads bench/results), also where nb_dist is installed from a wheel.
    (tmp_path / "bench").symlink_to(NOTEBOOKS.parent / "bench", target_is_directory=True)
    solutions = json.loads(notebook.read_text())
    found = {e.index: e for e in exercises(solutions, notebook.name)}
    checks = {e.check_index for e in found.values()}
    cells = solutions["cells"]
    kc = kernels().kc
    for index, cell in enumerate(cells):
        metadata = cell.get("metadata", {})
        if cell["cell_type"] != "code" or metadata.get("edition") == "solutions":
            continue
        where = f"{notebook.name} cell {index}"
        if index in found:
            _walk_exercise(kc, found[index], _source(cells[found[index].check_index]))
            continue
        run = _run(kc, _source(cell), where)
        if "raises-exception" in metadata.get("tags", []):
            continue
        run.expect_ok()
        if index in checks:
            assert "right:" in run.stdout(), f"{where}: the key did not pass: {run.stdout()!r}"
