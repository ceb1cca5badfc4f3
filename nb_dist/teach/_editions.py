"""The student edition of a teaching notebook, made from its solutions edition.

One source: the notebooks in ``notebooks/`` are the solutions edition (the answer key). An
exercise is a code cell whose metadata holds ``"exercise": {"id", "blank", "wrong"}``: its
source is the answer, ``blank`` is what the student gets (with ``...`` where the answer goes),
``wrong`` a plausible wrong answer, or a list of them (the exercise tests run each and expect
the check to fail).
The next code cell checks the answer. A cell with ``"edition": "solutions"`` in its metadata
exists only in the solutions edition. A markdown cell with ``"after_exercise": "<id>"``, after
that exercise's check cell (which calls ``check``/``check_code`` with ``exercise="<id>"``),
explains the answer: in the student edition it becomes a code cell
``explain("<id>", "<encoded>")`` (the text zlib-compressed, base64), which shows the text once
the check said "right" in the kernel (see :func:`nb_dist.teach.exercises.explain`).
The student edition carries no outputs and no key: each code cell is tagged
``nbval-ignore-output``, so nbval runs it and fails only on errors. Its "open in" badges
(Binder, Colab, Kaggle) open the student edition.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import zlib
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
    _check_after_checks(cells, found, name)
    return found


def _check_after_checks(cells: list[Cell], found: list[Exercise], name: str) -> None:
    """Refuse an after-check cell (see the module docstring) that cannot work, naming it."""
    by_id = {e.id: e for e in found}
    for index, cell in enumerate(cells):
        metadata = cell.get("metadata", {})
        if "after_exercise" not in metadata:
            continue
        where, ident = f"{name} cell {index}", str(metadata["after_exercise"])
        if cell["cell_type"] != "markdown":
            raise ValueError(f"{where}: an after-check cell must be a markdown cell")
        if "edition" in metadata:
            raise ValueError(f"{where}: an after-check cell is in both editions: drop 'edition'")
        exercise = by_id.get(ident)
        if exercise is None:
            raise ValueError(f"{where}: after_exercise {ident!r} is no exercise of the notebook")
        if index <= exercise.check_index:
            raise ValueError(
                f"{where}: the explanation of exercise {ident} must come after its check "
                f"(cell {exercise.check_index})"
            )
        check = _source(cells[exercise.check_index])
        if not any(f"exercise={q}{ident}{q}" in check for q in "\"'"):
            raise ValueError(
                f"{where}: exercise {ident}'s check (cell {exercise.check_index}) must pass "
                f'exercise="{ident}" to check/check_code, or the explanation never shows'
            )


def encode_explanation(text: str) -> str:
    """``text`` as an after-check cell carries it in the student edition: UTF-8, zlib, base64."""
    return base64.b64encode(zlib.compress(text.encode("utf-8"), 9)).decode("ascii")


def decode_explanation(encoded: str) -> str:
    """The text :func:`encode_explanation` encoded."""
    return zlib.decompress(base64.b64decode(encoded, validate=True)).decode("utf-8")


def _explain_source(exercise: str, text: str) -> str:
    return (
        f'# Exercise {exercise}, explained. Run this cell once the check above says "right"\n'
        "# (the explanation gives the answer away; explain(..., anyway=True) shows it at once).\n"
        "from nb_dist.teach.exercises import explain\n"
        f'explain("{exercise}", "{encode_explanation(text)}")'
    )


def student_edition(notebook: Notebook, name: str = "") -> Notebook:
    """The student edition of a solutions-edition notebook (see the module docstring); a
    malformed exercise or after-check cell raises ``ValueError`` naming ``name``."""
    exercises(notebook, name)
    student = copy.deepcopy(notebook)
    cells: list[Cell] = []
    for cell in student["cells"]:
        metadata = cell.setdefault("metadata", {})
        if metadata.pop("edition", None) == "solutions":
            continue
        spec = metadata.pop("exercise", None)
        if spec is not None:
            cell["source"] = _lines(str(spec["blank"]))
        explained = metadata.pop("after_exercise", None)
        if explained is not None:
            source = _explain_source(str(explained), _source(cell))
            cell.update(cell_type="code", source=_lines(source))
            cell.pop("attachments", None)
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
        student = student_edition(notebook, source.name)  # refuses a malformed exercise
        target = out / source.name
        target.write_text(dumps(student), encoding="utf-8")
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
        made = dumps(student_edition(notebook, source.name))
        if not target.exists() or _comparable(target.read_text(encoding="utf-8")) != _comparable(
            made
        ):
            stale.append(source.name)
    names = {s.name for s in sources}
    stale += sorted(p.name for p in out.glob("*.ipynb") if p.name not in names)
    return stale


# An after-check cell's encoded text, as dumps() writes it: explain(\"13-2\", \"eNp...\").
_ENCODED = re.compile(r'(explain\(\\"[^"\\]*\\", \\")([A-Za-z0-9+/=]+)(\\"\))')


def _comparable(text: str) -> str:
    """A dumped student edition with each explanation decoded: another zlib build may
    compress the same text to other bytes, and the edition is still current."""
    return _ENCODED.sub(lambda m: m[1] + repr(decode_explanation(m[2])) + m[3], text)
