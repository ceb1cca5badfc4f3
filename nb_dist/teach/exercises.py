"""``check`` and ``check_code``: a student's prediction or code against what the code computes.

Strict about types where a learner's slip would hide a misunderstanding: ``True`` is not
``1`` and ``0`` is not ``False``; a number is compared with a relative tolerance of 1e-6
(``4`` matches ``4.0``); lists and tuples compare element by element. An answer still holding
``...`` (the student edition's blank) is "not answered yet": it prints that and returns
``False`` without raising, so Run All goes on past an unanswered exercise. A wrong
prediction gets the hint first and what the code gives only on a second try (or on request):
see :func:`check`.

A check given ``exercise="<id>"`` records that exercise once it is right or revealed; then
:func:`explain` shows the exercise's explanation (the student edition's after-check cell),
which gives the answer away and so waits for that.
"""

from __future__ import annotations

import ast
import base64
import inspect
import math
import sys
import textwrap
import zlib
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")

NOT_ANSWERED = (
    "not answered yet: replace each ... in the cell above with your answer, then run that "
    "cell and this one again."
)


class WrongAnswer(AssertionError):
    """The answer differs from what the code computed; the message ends with a hint."""


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def same(answer: object, truth: object, rel: float = 1e-6) -> bool:
    """Whether ``answer`` matches ``truth`` under the rules in this module's docstring."""
    if isinstance(answer, bool) or isinstance(truth, bool):
        return isinstance(answer, bool) and isinstance(truth, bool) and answer == truth
    if _is_number(answer) and _is_number(truth):
        a, t = float(answer), float(truth)  # type: ignore[arg-type]
        if a == t or (math.isnan(a) and math.isnan(t)):
            return True
        return math.isfinite(a) and math.isfinite(t) and abs(a - t) <= rel * max(1.0, abs(t))
    if isinstance(answer, list | tuple) and isinstance(truth, list | tuple):
        return len(answer) == len(truth) and all(
            same(a, t, rel) for a, t in zip(answer, truth, strict=True)
        )
    if isinstance(answer, Mapping) and isinstance(truth, Mapping):
        return set(answer) == set(truth) and all(same(answer[k], truth[k], rel) for k in truth)
    if isinstance(answer, str | bytes) or isinstance(truth, str | bytes):
        return type(answer) is type(truth) and answer == truth
    if _is_number(answer) or _is_number(truth):
        return False  # a number against a string, a list, None...
    try:
        return bool(answer == truth)
    except Exception:  # e.g. tensors of different shapes
        return False


def _holds_ellipsis(node: ast.AST) -> bool:
    return any(
        isinstance(child, ast.Constant) and child.value is Ellipsis for child in ast.walk(node)
    )


def answered(answer: object) -> bool:
    """``False`` while the answer still holds the student edition's ``...``: the value itself,
    inside a list, tuple or dict, or anywhere in a function's source (a stub's body, or the
    ``...`` line in a loop to repair)."""
    if answer is Ellipsis:
        return False
    if isinstance(answer, list | tuple):
        return all(answered(item) for item in answer)
    if isinstance(answer, dict):
        return all(answered(item) for item in answer.values())
    if inspect.isfunction(answer) or inspect.ismethod(answer) or inspect.isclass(answer):
        try:
            source = textwrap.dedent(inspect.getsource(answer))
        except (OSError, TypeError):  # no source to read (e.g. built in a string): trust it
            return True
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return True
        return not _holds_ellipsis(tree)
    return True


#: How many wrong answers each prediction has had in this kernel, by its hint.
_wrong_tries: dict[str, int] = {}

#: The exercises whose check said "right" (or revealed the truth) in this kernel.
_explainable: set[str] = set()


def check(
    answer: object, truth: object, hint: str, reveal: bool = False, *, exercise: str = ""
) -> None:
    """Print ``right: <truth>`` when ``answer`` matches ``truth``; print :data:`NOT_ANSWERED`
    while it holds ``...``; otherwise raise :class:`WrongAnswer`, which stops the cell.

    A first wrong answer gets what was said and ``hint``, not the truth, so the student can
    try again. The truth (what the code gives) comes with the second wrong answer to the same
    exercise (the same ``hint``), or at once with ``reveal=True``: ``check(answer, ...,
    reveal=True)`` in the check cell shows it on request. Returns nothing, so a check cell
    shows only its line. ``exercise``: the id that :func:`explain` then knows as done."""
    if not answered(answer):
        print(NOT_ANSWERED)
        return
    if same(answer, truth):
        _explainable.add(exercise)
        print(f"right: {truth!r}")
        return
    tries = _wrong_tries[hint] = _wrong_tries.get(hint, 0) + 1
    if reveal or tries >= 2:
        _explainable.add(exercise)
        raise WrongAnswer(f"not quite: you said {answer!r}, the code gives {truth!r}. {hint}")
    raise WrongAnswer(
        f"not quite: you said {answer!r}. Try again with the hint (a second wrong answer, or "
        f"reveal=True in this check, shows what the code gives). {hint}"
    )


def check_code(
    solution: T,
    run: Callable[[T], object],
    expected: object,
    hint: str,
    *,
    exercise: str = "",
) -> None:
    """Check a student's code: ``run(solution)`` (which may launch ranks) must give
    ``expected``. While ``solution`` still holds ``...``, nothing runs: it prints
    :data:`NOT_ANSWERED`. ``exercise``: as for :func:`check`."""
    if not answered(solution):
        print(NOT_ANSWERED)
        return
    got = run(solution)
    if same(got, expected):
        _explainable.add(exercise)
        print(f"right: {expected!r}")
        return
    raise WrongAnswer(f"not yet: your code gives {got!r}, it should give {expected!r}. {hint}")


def _in_a_kernel() -> bool:
    """True inside a Jupyter kernel; never imports IPython (a kernel has imported it)."""
    shell_module = sys.modules.get("IPython.core.interactiveshell")
    if shell_module is None or not shell_module.InteractiveShell.initialized():
        return False
    return getattr(shell_module.InteractiveShell.instance(), "kernel", None) is not None


def explain(exercise: str, encoded: str, anyway: bool = False) -> None:
    """Show exercise ``exercise``'s explanation (``encoded``: its markdown, UTF-8, zlib,
    base64) once its check said "right" or revealed the answer, or at once with
    ``anyway=True``; before that, say why not."""
    if not (anyway or (exercise and exercise in _explainable)):
        print(
            f"Exercise {exercise}'s explanation gives its answer away, so solve the exercise "
            f'first (until its check says "right"), or run explain(..., anyway=True) to read '
            "it now."
        )
        return
    text = zlib.decompress(base64.b64decode(encoded, validate=True)).decode("utf-8")
    if _in_a_kernel():
        from IPython.display import Markdown, display

        display(Markdown(text))
    else:
        print(text)


__all__ = [
    "NOT_ANSWERED",
    "WrongAnswer",
    "answered",
    "check",
    "check_code",
    "explain",
    "same",
]
