"""The student edition of a teaching notebook, made from its solutions edition.

One source: the notebooks in ``notebooks/`` are the solutions edition (the answer key). An
exercise is a code cell whose metadata holds ``"exercise": {"id", "blank", "wrong"}``: its
source is the answer, ``blank`` is what the student gets (with ``...`` where the answer goes),
``wrong`` a plausible wrong answer, or a list of them (the exercise tests run each and expect
the check to fail).
The next code cell checks the answer. A cell with ``"edition": "solutions"`` in its metadata
exists only in the solutions edition. The student edition carries no outputs and no key: each
code cell is tagged ``nbval-ignore-output``, so nbval runs it and fails only on errors. Its
"open in" badges (Binder, Colab, Kaggle) open the student edition.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Notebook = dict[str, Any]
Cell = dict[str, Any]

BANNER = (
    "*Student edition.* Each exercise's answer is `...`: replace it with yours and run the "
    "cell and the check below it. A check on an unanswered exercise says so and Run All goes "
    "on. The answers are in the solutions edition (the notebook of the same name one folder up)."
)


@dataclass(frozen=True)
class Exercise:
    """One exercise of a notebook: where it is and its three versions of the answer cell."""

    notebook: str
    index: int  # the answer cell's index in the solutions edition
    check_index: int  # the next code cell: the check
    id: str
    key: str
    blank: str
    wrongs: tuple[str, ...]

    @property
    def wrong(self) -> str:
        """The first wrong answer (an exercise may list more: :attr:`wrongs`)."""
        return self.wrongs[0]


def _source(cell: Cell) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def exercises(notebook: Notebook, name: str = "") -> list[Exercise]:
    """The notebook's exercises in order; a malformed one raises ``ValueError`` naming it."""
    cells = notebook["cells"]
    found: list[Exercise] = []
    for index, cell in enumerate(cells):
        spec = cell.get("metadata", {}).get("exercise")
        if spec is None:
            continue
        where = f"{name} cell {index}"
        if cell["cell_type"] != "code":
            raise ValueError(f"{where}: an exercise must be a code cell")
        missing = {"id", "blank", "wrong"} - set(spec)
        if missing:
            raise ValueError(f"{where}: the exercise metadata lacks {sorted(missing)}")
        key, blank = _source(cell), str(spec["blank"])
        listed = spec["wrong"] if isinstance(spec["wrong"], list) else [spec["wrong"]]
        wrongs = tuple(str(wrong) for wrong in listed)
        if "..." not in blank:
            raise ValueError(f"{where}: the blank must hold '...' where the answer goes")
        if not wrongs or any(wrong.strip() == key.strip() for wrong in wrongs):
            raise ValueError(f"{where}: the wrong answer is the key itself")
        check_index = next(
            (k for k in range(index + 1, len(cells)) if cells[k]["cell_type"] == "code"), None
        )
        if check_index is None:
            raise ValueError(f"{where}: no code cell after the exercise checks it")
        found.append(Exercise(name, index, check_index, str(spec["id"]), key, blank, wrongs))
    ids = [e.id for e in found]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name}: exercise ids repeat: {ids}")
    return found


def student_edition(notebook: Notebook) -> Notebook:
    """The student edition of a solutions-edition notebook (see the module docstring)."""
    student = copy.deepcopy(notebook)
    cells: list[Cell] = []
    for cell in student["cells"]:
        metadata = cell.setdefault("metadata", {})
        if metadata.pop("edition", None) == "solutions":
            continue
        spec = metadata.pop("exercise", None)
        if spec is not None:
            cell["source"] = _lines(str(spec["blank"]))
        if cell["cell_type"] == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
            tags = metadata.setdefault("tags", [])
            if "nbval-ignore-output" not in tags:
                tags.append("nbval-ignore-output")
        cells.append(cell)
    _link_to_student_edition(cells)
    banner: Cell = {
        "cell_type": "markdown",
        "id": "student-edition",
        "metadata": {},
        "source": _lines(BANNER),
    }
    cells.insert(1 if cells and cells[0]["cell_type"] == "markdown" else 0, banner)
    student["cells"] = cells
    return student


# A link to a notebook of the solutions edition in the repository (the Binder, Colab and Kaggle
# badges of a notebook's first cell): "notebooks/NAME.ipynb" at the end of a URL's path.
_SOLUTIONS_LINK = re.compile(r"(/notebooks/)([^/()\s]+\.ipynb)(?=\))")


def _link_to_student_edition(cells: list[Cell]) -> None:
    """Point the first markdown cell's "open in" badges at the student edition itself."""
    for cell in cells:
        if cell["cell_type"] == "markdown":
            text = _SOLUTIONS_LINK.sub(r"\1student/\2", _source(cell))
            cell["source"] = _lines(text)
            return


def dumps(notebook: Notebook) -> str:
    """A notebook as nbformat writes it (so a re-save in Jupyter changes nothing)."""
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def write_student_editions(sources: Iterable[Path], out: Path) -> list[Path]:
    """Write the student edition of each source notebook into ``out``; return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for source in sorted(sources):
        notebook = json.loads(source.read_text(encoding="utf-8"))
        exercises(notebook, source.name)  # refuse a malformed exercise before writing
        target = out / source.name
        target.write_text(dumps(student_edition(notebook)), encoding="utf-8")
        written.append(target)
    return written


def stale_editions(sources: Iterable[Path], out: Path) -> list[str]:
    """The student editions in ``out`` that differ from what the sources make (or are
    missing, or have no source any more)."""
    sources = sorted(sources)
    stale = []
    for source in sources:
        target = out / source.name
        notebook = json.loads(source.read_text(encoding="utf-8"))
        if not target.exists() or target.read_text(encoding="utf-8") != dumps(
            student_edition(notebook)
        ):
            stale.append(source.name)
    names = {s.name for s in sources}
    stale += sorted(p.name for p in out.glob("*.ipynb") if p.name not in names)
    return stale
