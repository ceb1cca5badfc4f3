"""Where a student edition gives an exercise's answer away further down.

A student who has not answered an exercise reads on: the cells after it, and what they print
when run (the solutions edition's stored outputs, which are what running them shows). The key
must not be found there. Two kinds of trace are looked for:

- **values**: a prediction's answer (``answer = 0.375``): the number, its rounded and percent
  forms, or a list's numbers in order. Booleans are left out, and so is a small whole number
  (below 100) standing alone, for it appears everywhere: it counts only where it reads as the
  answer (:func:`_small_number_leaks`): after "is", "equals", "gives", "=" ... in markdown;
  beside a name of the check's truth (``check(answer, steps_taken, ...)``) in a code line's
  ``== 3`` or `` = 3``, or in a printed line (or a printed bare ``3`` of a cell that uses it);
- **lines**: a coding exercise's distinctive lines, compared with whitespace collapsed and
  comments dropped, under any function name: the ``def`` line, a loop over a plain name
  (``for x, y in loader:``), short lines (``return x``), and lines that the blank or the cells
  before the exercise already hold are not distinctive;
- **renamed lines**: a distinctive line with its variables renamed
  (``g = p.grad.to_local() / world`` for ``grad = param.grad.to_local() / world``): lines
  compare by their shape (:func:`shape`), each variable a placeholder in order of first use,
  attribute names, called names, keyword names, literals and operators kept. Only a line with
  at least :data:`MIN_STRUCTURE` such tokens counts, and not a shape the cells before hold.

The exercise's own check cell is scanned too (its source; its stored output is the key's
"right: ..."), and so are the markdown cells (recaps, explanations). An after-check cell's
explanation is encoded in the student edition (``explain("13-2", "eNp...")``): not readable,
not scanned.
"""

from __future__ import annotations

import ast
import builtins
import keyword
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ._editions import Exercise, Notebook, _source, exercises

#: A key line shorter than this (whitespace collapsed) is not distinctive.
MIN_LINE = 16
#: A renamed line must keep this many operators, attribute or called names and literals.
MIN_STRUCTURE = 3


@dataclass(frozen=True)
class Leak:
    """One trace of an exercise's key after the exercise, in the student edition."""

    notebook: str
    exercise: str
    cell: int  # the cell's index in the student edition
    where: str  # "source" or "output"
    found: str
    rule: str = "value"  # "value", "line", "renamed" (a key line renamed) or "small"

    def __str__(self) -> str:
        rule = "" if self.rule in ("value", "line") else f" [{self.rule}]"
        return (
            f"{self.notebook}: exercise {self.exercise}'s answer in cell {self.cell} "
            f"({self.where}){rule}: {self.found}"
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


_TOKEN = re.compile(
    r"""(?P<str>[rbfuRBFU]{0,2}(?:'[^'\\]*(?:\\.[^'\\]*)*'|"[^"\\]*(?:\\.[^"\\]*)*"))"""
    r"|(?P<num>\d[\w.]*)|(?P<name>[A-Za-z_]\w*)"
    r"|(?P<op>\*\*=?|//=?|->|:=|<<=?|>>=?|[-+*/%@&|^<>=!]=|[-+*/%@&|^~<>=.,:;()\[\]{}])"
)
_PUNCTUATION = {"(", ")", "[", "]", "{", "}", ",", ":", ";", "=", "."}
_NAMES_KEPT = set(keyword.kwlist) | {"self", "cls"}


def shape(line: str) -> tuple[tuple[str, ...], int]:
    """A code line with its variables renamed ``_0``, ``_1``... in order of first use (names
    after a ``.``, called names, keyword names and keywords kept), and how many of its tokens
    are structure: operators, kept names, literals (not brackets, commas, ``=``, keywords)."""
    tokens = [(m.lastgroup or "", m.group()) for m in _TOKEN.finditer(line)]
    names: dict[str, str] = {}
    out: list[str] = []
    structure = depth = 0
    for k, (kind, text) in enumerate(tokens):
        after = tokens[k + 1][1] if k + 1 < len(tokens) else ""
        before = tokens[k - 1][1] if k else ""
        depth += (text in "([{") - (text in ")]}") if kind == "op" else 0
        if kind == "name" and text in _NAMES_KEPT:
            out.append(text)
        elif kind == "name" and (before == "." or after == "(" or (after == "=" and depth > 0)):
            out.append(text)
            structure += 1
        elif kind == "name":
            out.append(names.setdefault(text, f"_{len(names)}"))
        else:
            out.append(text)
            structure += text not in _PUNCTUATION
    return tuple(out), structure


def _renamed_lines(lines: list[str], before: list[str]) -> dict[tuple[str, ...], str]:
    """The distinctive ``lines`` that keep enough structure renamed, by shape."""
    seen = {shape(_normal(line))[0] for text in before for line in text.splitlines()}
    found: dict[tuple[str, ...], str] = {}
    for line in lines:
        key, structure = shape(line)
        if structure >= MIN_STRUCTURE and key not in seen:
            found.setdefault(key, line)
    return found


_VERB = r"(?:is|are|was|were|equals?|gives?|gave|makes?|comes? to|totals?|stays?|remains?|≈)"
_ADVERB = r"(?:(?:still|now|only|just|exactly|always|then|again|also|simply|thus|so)\s+)?"
_MARK = r"(?:\*\*|\*|`|\$)?"
# 3 x 4, 3/4, 3.5, 3%, 3-way: not the answer 3 (\u00d7 and \u00b7 are multiplication signs)
_NOT_A_TERM = r"(?![\w%]|\.\d|\s*[x\u00d7\u00b7*/+^-]\s*\w)"
_BUILTINS = set(dir(builtins)) | {"torch", "dist", "np", "reference", "truth"}


def _truth_names(check: str) -> set[str]:
    """The names in the second argument of the check cell's ``check(answer, truth, ...)``."""
    try:
        tree = ast.parse(check)
    except SyntaxError:
        return set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "check"
            and len(node.args) >= 2
        ):
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            return {n for n in names - _BUILTINS if len(n) >= 3}
    return set()


def _small_number_leaks(
    number: int, names: set[str], cell_type: str, where: str, text: str, source: str
) -> list[str]:
    """Where a small whole-number answer reads as the answer (see the module docstring)."""
    n = rf"(?<![\w.]){number}(?:\.0+)?{_NOT_A_TERM}"
    named = re.compile(rf"\b(?:{'|'.join(map(re.escape, sorted(names)))})\b") if names else None
    found = []
    if where == "source" and cell_type == "markdown":
        said = rf"(?<!\w){_VERB}\s+{_ADVERB}{_MARK}{n}"
        if named is not None:  # `steps_taken = 0`, not `dim=0`
            said += rf"|{named.pattern}`?\s*==?\s*{_MARK}{n}"
        found += [m.group(0) for m in re.finditer(said, text)]
    elif where == "source" and named is not None:
        compared = re.compile(rf"(?:==|\s=)\s*{n}\s*(?:#|\)|$)")
        found += [
            line.strip()
            for line in text.splitlines()
            if named.search(_normal(line)) and compared.search(_normal(line))
        ]
    elif where == "output" and named is not None:
        for line in text.splitlines():
            if (named.search(line) and re.search(n, line)) or (
                line.strip() == str(number) and named.search(source)
            ):
                found.append(line.strip())
    return found


def _outputs_text(cell: dict[str, Any]) -> str:
    texts = []
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        for text in (output.get("text", ""), data.get("text/plain", ""), data.get("text/html", "")):
            texts.append("".join(text) if isinstance(text, list) else str(text))
    return "".join(texts)


# An after-check cell's encoded explanation in the student edition: not readable there.
_ENCODED = re.compile(r'(explain\("[^"\\]*", ")[A-Za-z0-9+/=]+(")')


def _small_answer(value: object) -> int | None:
    """A prediction's answer that is a whole number below 100 (not a boolean), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value != int(value) or abs(value) >= 100:
        return None
    return int(value)


def answer_leaks(solutions: Notebook, student: Notebook, name: str = "") -> list[Leak]:
    """Every trace of an exercise's key after the exercise in ``student`` (the student
    edition of ``solutions``): its source, and the stored outputs of the solutions edition's
    cells of the same id (the check cell's own "right:" excepted)."""
    by_id = {cell.get("id"): cell for cell in solutions["cells"]}
    cells = student["cells"]
    position = {cell.get("id"): index for index, cell in enumerate(cells)}
    leaks: list[Leak] = []
    for exercise in exercises(solutions, name):
        cell_id = solutions["cells"][exercise.index].get("id")
        if cell_id not in position:
            raise ValueError(f"{name}: the student edition lacks exercise {exercise.id}'s cell")
        start = position[cell_id]
        check_id = solutions["cells"][exercise.check_index].get("id")
        before = [_source(cell) for cell in cells[:start]]
        value = _answer_value(exercise.key)
        patterns = _value_patterns(value)
        small = _small_answer(value)
        names = _truth_names(_source(solutions["cells"][exercise.check_index]))
        lines = _distinctive_lines(exercise, before)
        renamed = _renamed_lines(lines, [exercise.blank, *before])
        for index in range(start + 1, len(cells)):
            cell = cells[index]
            source = _ENCODED.sub(r"\1\2", _source(cell))
            texts = [("source", source)]
            original = by_id.get(cell.get("id"), {})
            if cell.get("id") != check_id:
                texts.append(("output", _outputs_text(original)))
            for where, text in texts:
                for pattern in patterns:
                    for match in pattern.finditer(text):
                        leaks.append(Leak(name, exercise.id, index, where, match.group(0)))
                normal = [_normal(line) for line in text.splitlines()]
                joined = "\n".join(normal)
                exact = [line for line in lines if line in joined]
                leaks += [Leak(name, exercise.id, index, where, line, "line") for line in exact]
                for line in normal:
                    key = renamed.get(shape(line)[0])
                    if key is not None and key not in exact and not any(e in line for e in exact):
                        leaks.append(Leak(name, exercise.id, index, where, line, "renamed"))
                if small is not None:
                    kind = cell["cell_type"]
                    found = _small_number_leaks(small, names, kind, where, text, source)
                    leaks += [Leak(name, exercise.id, index, where, f, "small") for f in found]
    return leaks
