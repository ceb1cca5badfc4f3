"""Where a student edition gives an exercise's answer away further down.

A student who has not answered an exercise reads on: the cells after it, and what they print
when run (the solutions edition's stored outputs, which are what running them shows). The key
must not be found there. Two kinds of trace are looked for:

- **values**: a prediction's answer (``answer = 0.375``): the number, its rounded and percent
  forms, or a list's numbers in order. Small whole numbers (below 100) and booleans are left
  out: they appear everywhere and give nothing away by themselves;
- **lines**: a coding exercise's distinctive lines, compared with whitespace collapsed and
  comments dropped, under any function name: the ``def`` line, a loop over a plain name
  (``for x, y in loader:``), short lines (``return x``), and lines that the blank or the cells
  before the exercise already hold are not distinctive.

The exercise's own check cell is scanned too (its source; its stored output is the key's
"right: ..."), and so are the markdown cells (recaps, explanations).
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ._editions import Exercise, Notebook, _source, exercises

#: A key line shorter than this (whitespace collapsed) is not distinctive.
MIN_LINE = 16


@dataclass(frozen=True)
class Leak:
    """One trace of an exercise's key after the exercise, in the student edition."""

    notebook: str
    exercise: str
    cell: int  # the cell's index in the student edition
    where: str  # "source" or "output"
    found: str

    def __str__(self) -> str:
        return (
            f"{self.notebook}: exercise {self.exercise}'s answer in cell {self.cell} "
            f"({self.where}): {self.found}"
        )


def _normal(line: str) -> str:
    return " ".join(line.split("#", 1)[0].split())


def _value_patterns(value: object) -> list[re.Pattern[str]]:
    """Regular expressions that find ``value`` written out (see the module docstring)."""
    if isinstance(value, bool) or value is None or value is Ellipsis:
        return []
    if isinstance(value, int | float):
        number = float(value)
        if not math.isfinite(number):
            return []
        if number == int(number):
            if abs(number) < 100:
                return []
            whole = int(number)
            forms = {str(whole), f"{whole:,}", f"{whole:_}"}
        else:
            forms = {repr(number), f"{number:.2f}", f"{number:.3g}", f"{number:g}"}
            forms = {f for f in forms if float(f) != int(float(f))}
            if 0 < abs(number) < 1:
                percent = number * 100
                forms.add(f"{percent:g} ?%")
                fraction = Fraction(number).limit_denominator(16)
                if float(fraction) == number and fraction.denominator > 4:
                    forms.add(f"{fraction.numerator} ?/ ?{fraction.denominator}")
        escaped = sorted(re.escape(f).replace(r"\ \?", " ?") for f in forms)
        return [re.compile(rf"(?<![\d.]){form}(?!\d|\.\d)") for form in escaped]
    if isinstance(value, list | tuple) and len(value) >= 2:
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            items = r"\s*,\s*".join(re.escape(repr(v)) for v in value)
            return [re.compile(rf"[\[(]\s*{items}\s*[\])]")]
        return [p for v in value for p in _value_patterns(v)]
    if isinstance(value, str) and len(value) >= 4:
        return [re.compile(re.escape(value))]
    return []


def _answer_value(key: str) -> object:
    """The value of a prediction's ``answer = ...`` line, or ``None`` for a coding exercise."""
    try:
        tree = ast.parse(key)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "answer" for t in node.targets
        ):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
    return None


# A function's first line, and a loop over a name or an argument-less call (``for p in
# model.parameters():``): every solution has them, they say nothing of the answer.
_TRIVIAL = re.compile(r"(async )?def \w+\(|for [\w, ()]+ in [\w.]+(\(\))?:$")


def _distinctive_lines(exercise: Exercise, before: list[str]) -> list[str]:
    """The key's lines that only an answer would hold (see the module docstring)."""
    seen = {_normal(line) for text in [exercise.blank, *before] for line in text.splitlines()}
    lines = []
    for line in exercise.key.splitlines():
        normal = _normal(line)
        if len(normal) < MIN_LINE or normal in seen or _TRIVIAL.match(normal):
            continue
        lines.append(normal)
    return lines


def _outputs_text(cell: dict[str, Any]) -> str:
    texts = []
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        for text in (output.get("text", ""), data.get("text/plain", ""), data.get("text/html", "")):
            texts.append("".join(text) if isinstance(text, list) else str(text))
    return "".join(texts)


def answer_leaks(solutions: Notebook, student: Notebook, name: str = "") -> list[Leak]:
    """Every trace of an exercise's key after the exercise in ``student`` (the student
    edition of ``solutions``): its source, and the stored outputs of the solutions edition's
    cells of the same id (the check cell's own "right:" excepted)."""
    by_id = {cell.get("id"): cell for cell in solutions["cells"]}
    cells = student["cells"]
    position = {cell.get("id"): index for index, cell in enumerate(cells)}
    leaks: list[Leak] = []
    for exercise in exercises(solutions, name):
        start = position[solutions["cells"][exercise.index].get("id")]
        check_id = solutions["cells"][exercise.check_index].get("id")
        before = [_source(cell) for cell in cells[:start]]
        patterns = _value_patterns(_answer_value(exercise.key))
        lines = _distinctive_lines(exercise, before)
        for index in range(start + 1, len(cells)):
            cell = cells[index]
            texts = [("source", _source(cell))]
            original = by_id.get(cell.get("id"), {})
            if cell.get("id") != check_id:
                texts.append(("output", _outputs_text(original)))
            for where, text in texts:
                for pattern in patterns:
                    for match in pattern.finditer(text):
                        leaks.append(Leak(name, exercise.id, index, where, match.group(0)))
                normal = "\n".join(_normal(line) for line in text.splitlines())
                leaks += [
                    Leak(name, exercise.id, index, where, line) for line in lines if line in normal
                ]
    return leaks
