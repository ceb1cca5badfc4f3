"""The exercises' checks and the student edition, as pure functions and as the command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_helpers import execute

from nb_dist.teach import NOT_ANSWERED, WrongAnswer, answered, check, check_code, explain
from nb_dist.teach._editions import (
    BANNER,
    decode_explanation,
    dumps,
    exercises,
    stale_editions,
    student_edition,
    write_student_editions,
)
from nb_dist.teach._leaks import answer_leaks
from nb_dist.teach.exercises import same

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


# ------------------------------------------------------------------------------------ check
@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        (4, 4),
        (4, 4.0),
        (4.0, 4),
        (0.1 + 0.2, 0.3),
        (float("inf"), float("inf")),
        ([3, 7, 0], [3, 7, 0]),
        ([3, 7, 0], (3, 7, 0)),
        ((float("inf"), 1.0), (float("inf"), 1)),
        (False, False),
        (True, True),
        ("gloo", "gloo"),
        ({"a": 1}, {"a": 1.0}),
        (None, None),
    ],
)
def test_matching_answers(answer, truth):
    assert same(answer, truth)


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        (0, False),  # a learner's 0 is not the boolean the code computed
        (True, 1),
        (1, True),
        (False, 0.0),
        (2.86, 2.857142857),  # rounded too far
        (3, 4),
        ([3, 7], [3, 7, 0]),
        ([3, 7, "0"], [3, 7, 0]),
        ("4", 4),
        (4, "4"),
        (None, 0),
        ({"a": 1}, {"b": 1}),
        (float("nan"), 1.0),
        (float("inf"), 65504.0),
    ],
)
def test_answers_that_do_not_match(answer, truth):
    assert not same(answer, truth)


def test_check_prints_right(capsys):
    assert check(4, 4.0, "Hint: none needed.") is None  # nothing for a cell to display
    assert capsys.readouterr().out == "right: 4.0\n"


def test_check_raises_with_what_was_said_and_the_hint_and_the_truth_only_on_a_second_try():
    hint = "Hint: the weights differ."
    with pytest.raises(WrongAnswer) as first:
        check(0, False, hint)
    message = str(first.value)
    assert "you said 0" in message and "False" not in message and message.endswith(hint)
    assert isinstance(first.value, AssertionError)  # an `except AssertionError` still works
    with pytest.raises(WrongAnswer) as second:
        check(1, False, hint)
    assert "you said 1" in str(second.value) and "gives False" in str(second.value)
    assert str(second.value).endswith(hint)


def test_check_reveals_the_truth_on_request(capsys):
    with pytest.raises(WrongAnswer, match=r"you said 3, the code gives 4\. Hint: add\."):
        check(3, 4, "Hint: add.", reveal=True)
    check(4, 4, "Hint: add.", reveal=True)  # a right answer is right, revealed or not
    assert capsys.readouterr().out == "right: 4\n"


@pytest.mark.parametrize("blank", [..., [..., 2], (1, ...), {"x": ...}])
def test_a_blank_answer_is_not_answered_yet_and_does_not_raise(blank, capsys):
    assert not answered(blank)
    check(blank, 1, "Hint.")
    assert capsys.readouterr().out == NOT_ANSWERED + "\n"


def _stub(model): ...


def _repair(values):
    total = 0
    for _value in values:
        ...  # repair: add the value to the total
    return total


def _solved(values):
    return sum(values)


def test_a_function_is_answered_once_no_ellipsis_is_left_in_it():
    assert not answered(_stub)
    assert not answered(_repair)
    assert answered(_solved)
    assert answered(len)  # no Python source to read: taken as answered
    namespace: dict[str, object] = {}
    exec("def built(x):\n    ...\n", namespace)  # no source file: taken as answered
    assert answered(namespace["built"])


def test_check_code_runs_only_answered_code(capsys):
    ran = []

    def run(fn):
        ran.append(fn)
        return fn([1, 2, 3])

    check_code(_repair, run, 6, "Hint.")
    assert ran == [] and capsys.readouterr().out == NOT_ANSWERED + "\n"
    check_code(_solved, run, 6, "Hint.")
    assert capsys.readouterr().out == "right: 6\n"
    with pytest.raises(WrongAnswer, match=r"your code gives 2, it should give 6\. Hint: sum\."):
        check_code(lambda values: len(values) - 1, run, 6, "Hint: sum.")


# ------------------------------------------------------------------------------- editions
def _notebook(*cells: dict) -> dict:
    return {"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def _code(source: str, **metadata: object) -> dict:
    return {
        "cell_type": "code",
        "execution_count": 3,
        "id": f"c{abs(hash(source)) % 10**6}",
        "metadata": dict(metadata),
        "outputs": [{"name": "stdout", "output_type": "stream", "text": ["right: 4\n"]}],
        "source": source,
    }


def _markdown(source: str, **metadata: object) -> dict:
    return {"cell_type": "markdown", "id": "m", "metadata": dict(metadata), "source": source}


EXERCISE = {"id": "x-1", "blank": "answer = ...  # your prediction", "wrong": "answer = 3"}


def test_the_student_edition_has_blanks_no_key_no_outputs():
    source = _notebook(
        _markdown("# Title"),
        _code("answer = 4  # your prediction", exercise=EXERCISE),
        _code("check(answer, 2 + 2, 'Hint.')", tags=["raises-exception"]),
        _markdown("Four, because two and two.", edition="solutions"),
    )
    student = student_edition(source)
    sources = ["".join(c["source"]) for c in student["cells"]]
    assert sources == ["# Title", BANNER, EXERCISE["blank"], "check(answer, 2 + 2, 'Hint.')"]
    text = dumps(student)
    assert "answer = 4" not in text and "answer = 3" not in text and "two and two" not in text
    for cell in student["cells"]:
        assert "exercise" not in cell["metadata"] and "edition" not in cell["metadata"]
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None
            assert "nbval-ignore-output" in cell["metadata"]["tags"]
    assert "raises-exception" in student["cells"][3]["metadata"]["tags"]
    assert source["cells"][1]["source"] == "answer = 4  # your prediction"  # source untouched


@pytest.mark.parametrize(
    ("spec", "cells_after", "message"),
    [
        ({"id": "a", "blank": "answer = 0", "wrong": "answer = 3"}, 1, "must hold '...'"),
        ({"id": "a", "blank": "answer = ...", "wrong": "answer = 4"}, 1, "the key itself"),
        ({"id": "a", "blank": "answer = ..."}, 1, "lacks ['wrong']"),
        (EXERCISE, 0, "no code cell after"),
    ],
)
def test_a_malformed_exercise_is_refused_by_name(spec, cells_after, message):
    cells = [_code("answer = 4", exercise=spec)] + [_code("check(answer, 4, 'h')")] * cells_after
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        exercises(_notebook(*cells), "lesson.ipynb")
    assert "lesson.ipynb cell 0" in str(caught.value)


def test_repeated_ids_are_refused():
    cells = [_code("answer = 4", exercise=EXERCISE), _code("check()")] * 2
    with pytest.raises(ValueError, match="ids repeat"):
        exercises(_notebook(*cells), "lesson.ipynb")


# ------------------------------------------------------------------------ after-check cells
EXPLANATION = "Four: **two and two**, ünïcode and all.\n\n```python\nanswer = 4\n```\n"


def _explained(exercise_id: str, check: str | None = None) -> dict:
    """A notebook: an exercise, its check (with ``exercise=``), then its explanation."""
    spec = {**EXERCISE, "id": exercise_id}
    check = check or f"check(answer, 2 + 2, 'Hint.', exercise={exercise_id!r})"
    return _notebook(
        _markdown("# Title"),
        _code("answer = 4  # your prediction", exercise=spec),
        _code(check),
        {**_markdown(EXPLANATION, after_exercise=exercise_id), "id": "explained"},
    )


def _explain_cell(student: dict) -> dict:
    (cell,) = [c for c in student["cells"] if c["id"] == "explained"]
    return cell


def test_an_after_check_cell_is_an_encoded_explain_call_in_the_student_edition():
    source = _explained("e-1")
    student = student_edition(source)
    cell = _explain_cell(student)
    assert cell["cell_type"] == "code" and cell["outputs"] == []
    assert cell["metadata"] == {"tags": ["nbval-ignore-output"]}
    lines = "".join(cell["source"]).splitlines()
    assert lines[:3] == [
        '# Exercise e-1, explained. Run this cell once the check above says "right"',
        "# (the explanation gives the answer away; explain(..., anyway=True) shows it at once).",
        "from nb_dist.teach.exercises import explain",
    ]
    assert all(len(line) <= 100 for line in lines[:3])
    call = re.fullmatch(r'explain\("e-1", "([A-Za-z0-9+/=]+)"\)', lines[3])
    assert call and decode_explanation(call[1]) == EXPLANATION  # the round trip
    assert "two and two" not in dumps(student) and "answer = 4" not in dumps(student)
    assert source["cells"][3]["cell_type"] == "markdown"  # the solutions edition keeps it


def test_the_explain_cell_shows_the_text_only_after_a_right_check(capsys):
    code = "".join(_explain_cell(student_edition(_explained("e-2")))["source"])
    exec(code, {})
    refusal = capsys.readouterr().out
    assert "Exercise e-2's explanation gives its answer away" in refusal
    assert "two and two" not in refusal and "anyway=True" in refusal
    check(4, 2 + 2, "Hint.", exercise="e-2")
    assert capsys.readouterr().out == "right: 4\n"
    exec(code, {})
    assert capsys.readouterr().out == EXPLANATION + "\n"  # no kernel here: printed


def test_a_revealed_truth_or_right_code_also_unlocks_the_explanation(capsys):
    encoded = "".join(_explain_cell(student_edition(_explained("e-3")))["source"])
    encoded = encoded.rsplit('"', 2)[1]
    with pytest.raises(WrongAnswer):
        check(3, 4, "Hint: e-3.", exercise="e-3")  # a first wrong try reveals nothing
    explain("e-3", encoded)
    assert "gives its answer away" in capsys.readouterr().out
    with pytest.raises(WrongAnswer, match="the code gives 4"):
        check(5, 4, "Hint: e-3.", exercise="e-3")  # the second one does
    explain("e-3", encoded)
    assert capsys.readouterr().out == EXPLANATION + "\n"
    check_code(_solved, lambda fn: fn([1, 2]), 3, "Hint.", exercise="e-4")
    explain("e-4", encoded)
    assert capsys.readouterr().out == "right: 3\n" + EXPLANATION + "\n"
    explain("e-5", encoded, anyway=True)
    assert capsys.readouterr().out == EXPLANATION + "\n"


@pytest.mark.parametrize(
    ("cells", "message"),
    [
        ([1, 2, "after:x-9"], "after_exercise 'x-9' is no exercise of the notebook"),
        ([1, "after:x-1", 2], "must come after its check (cell 2)"),
        ([1, "check:plain", "after:x-1"], 'check (cell 1) must pass exercise="x-1"'),
        ([1, 2, "code-after:x-1"], "an after-check cell must be a markdown cell"),
        ([1, 2, "both:x-1"], "is in both editions: drop 'edition'"),
    ],
)
def test_a_misplaced_after_check_cell_is_refused_by_name(cells, message):
    made = []
    for cell in cells:
        if cell == 1:
            made.append(_code("answer = 4", exercise=EXERCISE))
        elif cell == 2:
            made.append(_code('check(answer, 4, "h", exercise="x-1")'))
        elif cell == "check:plain":
            made.append(_code('check(answer, 4, "h")'))
        else:
            kind, ident = str(cell).split(":")
            metadata: dict[str, object] = {"after_exercise": ident}
            if kind == "both":
                metadata["edition"] = "solutions"
            made.append((_code if kind == "code-after" else _markdown)("Four.", **metadata))
    notebook = _notebook(*made)
    index = next(i for i, c in enumerate(cells) if "after" in str(c) or "both" in str(c))
    for refuse in (lambda: exercises(notebook, "lesson.ipynb"), lambda: student_edition(
        notebook, "lesson.ipynb")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(message)) as caught:
            refuse()
        assert f"lesson.ipynb cell {index}" in str(caught.value)


@pytest.mark.kernel
def test_explain_in_a_real_kernel_waits_for_the_check_then_shows_markdown(kernel):
    """The student edition's cells, run in a real kernel: the explanation is refused before the
    check says "right", shown (as Markdown) after it, and at once with anyway=True."""
    _, kc = kernel
    student = student_edition(_explained("k-1"))
    explain_cell = "".join(_explain_cell(student)["source"])
    before = execute(kc, explain_cell).expect_ok()
    assert "Exercise k-1's explanation gives its answer away" in before.stdout()
    shown = [m for m in before.mine if m.msg_type in ("display_data", "execute_result")]
    assert shown == [] and "two and two" not in before.stdout()
    execute(kc, "from nb_dist.teach import check\nanswer = 4").expect_ok()
    right = execute(kc, "".join(student["cells"][3]["source"])).expect_ok()  # the check cell
    assert right.stdout() == "right: 4\n"
    after = execute(kc, explain_cell).expect_ok()
    displays = [m.content["data"] for m in after.mine if m.msg_type == "display_data"]
    assert after.stdout() == "" and len(displays) == 1
    assert displays[0]["text/markdown"] == EXPLANATION
    anyway = explain_cell.replace('explain("k-1"', 'explain("k-2"')[:-1] + ", anyway=True)"
    early = execute(kc, anyway).expect_ok()
    displays = [m.content["data"] for m in early.mine if m.msg_type == "display_data"]
    assert early.stdout() == "" and [d["text/markdown"] for d in displays] == [EXPLANATION]


def test_the_committed_student_editions_are_current():
    """notebooks/student/ is what `nb-dist student-edition` makes of notebooks/ today."""
    sources = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert stale_editions(sources, NOTEBOOKS / "student") == []


def test_every_teaching_notebook_has_exercises_and_the_kit_has_coding_ones():
    counts = {
        p.name: exercises(json.loads(p.read_text()), p.name)
        for p in sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))
    }
    assert all(counts.values()), [name for name, found in counts.items() if not found]
    coding = [e.id for found in counts.values() for e in found if "def " in e.key]
    assert len(coding) >= 5, coding


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nb_dist", "student-edition", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
    )


def test_the_command_writes_checks_and_refuses(tmp_path):
    lesson = tmp_path / "lesson.ipynb"
    lesson.write_text(
        dumps(_notebook(_code("answer = 4", exercise=EXERCISE), _code("check(answer, 4, 'h')")))
    )
    out = tmp_path / "student"
    stale = _cli("lesson.ipynb", "--out", "student", "--check", cwd=tmp_path)
    assert stale.returncode == 1 and "out of date in student: lesson.ipynb" in stale.stderr
    made = _cli("lesson.ipynb", "--out", "student", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert write_student_editions([lesson], tmp_path / "again") == [
        tmp_path / "again" / lesson.name
    ]
    assert (out / "lesson.ipynb").read_text() == (tmp_path / "again" / "lesson.ipynb").read_text()
    current = _cli("lesson.ipynb", "--out", "student", "--check", cwd=tmp_path)
    assert current.returncode == 0 and "are current" in current.stdout
    missing = _cli("nothere.ipynb", "--out", "student", cwd=tmp_path)
    assert missing.returncode == 2 and "no such notebook: nothere.ipynb" in missing.stderr
    lesson.write_text(dumps(_notebook(_code("answer = 4", exercise={"id": "a"}), _code("c"))))
    bad = _cli("lesson.ipynb", "--out", "student", cwd=tmp_path)
    assert bad.returncode == 2 and "lacks ['blank', 'wrong']" in bad.stderr


def test_no_student_edition_gives_a_prediction_away():
    """The key's answer line (``answer = 4``) appears nowhere in the student edition."""
    for source in sorted(NOTEBOOKS.glob("*.ipynb")):
        student = (NOTEBOOKS / "student" / source.name).read_text()
        for exercise in exercises(json.loads(source.read_text()), source.name):
            if exercise.key.startswith("answer = "):
                line = exercise.key.splitlines()[0].split("#")[0].strip()
                assert json.dumps(line)[1:-1] not in student, (source.name, exercise.id, line)


def test_no_student_edition_holds_an_answer_after_its_exercise():
    """Every exercise's key (a prediction's value, a coding answer's distinctive lines under any
    name) appears nowhere after the exercise in the student edition: not in a cell's source,
    not in what the cell prints when run (the solutions edition's stored outputs)."""
    leaks = []
    for source in sorted(NOTEBOOKS.glob("*.ipynb")):
        student = json.loads((NOTEBOOKS / "student" / source.name).read_text())
        leaks += answer_leaks(json.loads(source.read_text()), student, source.name)
    assert not leaks, "\n".join(map(str, leaks))


#: The most ranks a teaching notebook may launch: each must run on a 2-core machine.
MAX_RANKS = 4
_LAUNCH = re.compile(
    r"(?:num_processes=|nprocs=|nproc[-_]per[-_]node[= ]|--num_processes[= ])(\d+)"
)


def test_no_notebook_launches_more_than_four_ranks():
    """``num_processes=``, ``nprocs=`` and the launchers' rank counts, in every cell."""
    for source in sorted(NOTEBOOKS.glob("*.ipynb")):
        for index, cell in enumerate(json.loads(source.read_text())["cells"]):
            text = "".join(cell["source"])
            ranks = [int(n) for n in _LAUNCH.findall(text)]
            assert all(n <= MAX_RANKS for n in ranks), (source.name, index, ranks)


def _scan(*cells: dict) -> list[str]:
    notebook = _notebook(*cells)
    leaks = answer_leaks(notebook, student_edition(notebook), "lesson.ipynb")
    return [f"{leak.exercise} {leak.cell} {leak.where} {leak.found}" for leak in leaks]


def test_the_scan_finds_a_value_printed_or_written_below_and_a_key_redefined():
    prediction = {"id": "p", "blank": "answer = ...", "wrong": "answer = 0.5"}
    printed = _code("print(bubble)")
    printed["outputs"] = [{"name": "stdout", "output_type": "stream", "text": ["0.375\n"]}]
    assert _scan(
        _code("answer = 0.375", exercise=prediction),
        _code("check(answer, bubble, 'h')"),
        printed,
        _markdown("So the bubble is 3/8, or 37.5%; 10.375 and 0.3751 are other numbers."),
    ) == ["p 3 output 0.375", "p 4 source 3/8", "p 4 source 37.5%"]
    key = "def merge(a, b):\n    m = torch.maximum(a, b)  # the larger\n    return m\n"
    coding = {"id": "c", "blank": "def merge(a, b):\n    ...\n", "wrong": "def merge(a, b): 0"}
    assert _scan(
        _code(key, exercise=coding),
        _code("check_code(merge, run, True, 'h')"),
        _code("def merge_blocks(x, y):\n    m   =  torch.maximum(a, b)\n    return m\n"),
    ) == ["c 3 source m = torch.maximum(a, b)"]
    assert _scan(_code("answer = 3", exercise=prediction), _code("print(3)")) == []  # small


def test_the_scan_finds_a_key_line_renamed_but_not_a_plain_or_earlier_shape():
    key = "def mean(param, world):\n    grad = param.grad.to_local() / world\n    return grad\n"
    coding = {"id": "c", "blank": "def mean(param, world):\n    ...\n", "wrong": "def mean(): 0"}
    exercise = [_code(key, exercise=coding), _code("check_code(mean, run, True, 'h')")]
    renamed = _code("def other(p, n):\n    g = p.grad.to_local() / n  # renamed\n    return g\n")
    assert _scan(*exercise, renamed) == ["c 3 source g = p.grad.to_local() / n"]
    assert _scan(*exercise, _code("g = p.grad.to_local() * n\nh = p.grad.to_local()\n")) == []
    earlier = _code("u = w.grad.to_local() / k")  # the shape was taught before the exercise
    assert _scan(earlier, *exercise, renamed) == []
    plain = "def pick(a, b):\n    largest = torch.maximum(a, b)\n    return largest\n"
    coding = {"id": "p", "blank": "def pick(a, b):\n    ...\n", "wrong": "def pick(a, b): 0"}
    assert _scan(  # one call is too little structure to tell a renamed key from new code
        _code(plain, exercise=coding), _code("check_code(pick, run, True, 'h')"),
        _code("m = torch.maximum(x, y)"),
    ) == []  # fmt: skip


def test_the_scan_finds_a_small_answer_only_where_it_reads_as_the_answer():
    prediction = {"id": "s", "blank": "answer = ...", "wrong": "answer = 20"}
    printed = _code("print('steps_taken in the kernel:', steps_taken)\nprint(steps_taken)")
    printed["outputs"] = [{"name": "stdout", "output_type": "stream",
                           "text": ["steps_taken in the kernel: 0\n", "0\n"]}]  # fmt: skip
    other = _code("print(len(ranks))")
    other["outputs"] = [{"name": "stdout", "output_type": "stream", "text": ["0\n"]}]
    said = (
        "Nothing changed: the counter is still 0; `Shard(dim=0)`, rank 0 and 0.5 are other "
        "numbers, and so are 0 x 4 and `steps_taken` = 0.5."
    )
    assert _scan(
        _code("answer = 0", exercise=prediction),
        _code("check(answer, steps_taken, 'h')"),
        _markdown(said),
        printed,
        other,
        _code("assert steps_taken == 0\nx = steps_taken + 0\nmake(steps_taken, 0)\n"),
        _markdown("`steps_taken = 0` here."),
    ) == [
        "s 3 source is still 0",
        "s 4 output steps_taken in the kernel: 0",
        "s 4 output 0",
        "s 6 source assert steps_taken == 0",
        "s 7 source steps_taken = 0",
    ]


def test_the_scan_does_not_read_an_encoded_explanation():
    prediction = {"id": "e", "blank": "answer = ...", "wrong": "answer = 0.5"}
    notebook = _notebook(
        _code("answer = 0.375", exercise=prediction),
        _code("check(answer, bubble, 'h', exercise='e')"),
        {**_markdown("The bubble is 0.375, or 3/8.", after_exercise="e"), "id": "explained"},
    )
    student = student_edition(notebook)
    assert "explain(" in "".join(student["cells"][3]["source"])
    assert answer_leaks(notebook, student, "lesson.ipynb") == []


def test_the_reference_implementations_are_the_exercises_answers():
    from nb_dist.teach import reference

    assert reference.block_activations(2, 16, 32, 2) == 4 * (
        16 * 2 * 16 * 32 + 2 * 2 * 16 * 16 + 4 * 2 * 16
    )
    assert reference.tp_block_parameters(64, 2) == 25184  # notebook 13's block on 2 ranks
    assert reference.tp_block_parameters(64, 1) == 12 * 64 * 64 + 13 * 64  # the whole block
    assert reference.tp_block_activations(2, 16, 32, 2, 1) == reference.block_activations(
        2, 16, 32, 2
    )
    assert reference.tp_block_activations(8, 32, 64, 4, 2) == 724992
    assert reference.torch_1f1b(4, 6, 1) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3),
                                             ("B", 1), ("F", 4), ("B", 2), ("F", 5), ("B", 3),
                                             ("B", 4), ("B", 5)]  # fmt: skip
    assert reference.torch_1f1b(2, 1, 0) == [("F", 0), ("B", 0)]
    assert reference.bubble_formula(4, 16) == 0.1875  # notebook 17, exercise 17-1
    # notebook 17, exercise 17-3 (the interleaved forwards) and the order built from them
    forwards = reference.interleaved_forwards(2, 2, 4, 1)
    assert forwards == [(1, 0), (1, 1), (3, 0), (3, 1), (1, 2), (1, 3), (3, 2), (3, 3)]
    assert reference.interleaved_forwards(4, 1, 4, 2) == [(2, 0), (2, 1), (2, 2), (2, 3)]
    assert reference.interleaved_1f1b(2, 2, 2, 1) == [("F", 1, 0), ("F", 1, 1), ("F", 3, 0),
                                                      ("B", 3, 0), ("F", 3, 1), ("B", 3, 1),
                                                      ("B", 1, 0), ("B", 1, 1)]  # fmt: skip
    for p, v, m in [(2, 2, 4), (4, 2, 8), (3, 3, 6)]:  # each forward and backward once
        for r in range(p):
            order = reference.interleaved_1f1b(p, v, m, r)
            expected = {(s, j) for s in range(r, v * p, p) for j in range(m)}
            assert sorted(order) == sorted({(k, s, j) for k in "FB" for s, j in expected})
    # notebook 17, after exercise 17-2: ZB-H1, 1F1B's F and B with a W after each B, late
    assert reference.zb_h1(2, 2, 1) == [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1),
                                        ("W", 1, 0), ("W", 1, 1)]  # fmt: skip
    for p, m in [(2, 4), (4, 8), (3, 3)]:
        for r in range(p):
            order = reference.zb_h1(p, m, r)
            assert [(k, j) for k, _, j in order if k != "W"] == reference.torch_1f1b(p, m, r)
            assert [j for k, _, j in order if k == "W"] == list(range(m))
    # notebook 16, after exercises 16-2 (a linear layer's local backward) and 16-3
    import torch

    linear = torch.nn.Linear(6, 3)
    x = torch.randn(2, 5, 6, requires_grad=True)
    dy = torch.randn(2, 5, 3)
    linear(x).backward(dy)
    grads = reference.linear_backward(dy, x.detach(), linear.weight.detach())
    expected = (x.grad, linear.weight.grad, linear.bias.grad)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, expected, strict=True))
    block = torch.nn.Module()
    block.ln1, block.ln2 = torch.nn.LayerNorm(4), torch.nn.LayerNorm(4)
    block.attn, block.mlp = torch.nn.Module(), torch.nn.Module()
    block.attn.proj, block.mlp.fc2 = torch.nn.Linear(4, 4), torch.nn.Linear(16, 4)
    assert sum(p.numel() for p in reference.sp_partial_parameters(block)) == 6 * 4
    # notebook 22, exercises 22-4 (a 2-D shard) and 22-5 (a pp group)
    import torch

    full = torch.arange(8 * 4).reshape(8, 4)
    assert torch.equal(reference.fsdp_tp_shard(full, 0, 1, 0, 2, 2), full[2:4])
    assert torch.equal(reference.fsdp_tp_shard(full, 1, 1, 1, 2, 2), full[4:, 2:])
    assert reference.pp_group_ranks(6, 2, 2, 2) == [2, 6]
    assert reference.pp_group_ranks(5, 4, 1, 2) == [1, 3, 5, 7]
    # notebook 22, exercise 22-6 (a plan's memory and traffic), on the notebook's small block:
    # FSDP x TP's states are section 6's measured 12288 B; one rank alone moves nothing
    block = dict(psi=3072, layers=1, hidden=16, heads=4, seq=8, micro_batch=2, microbatches=1)
    alone = reference.plan_costs(block, {"pp": 1, "dp": 1, "cp": 1, "tp": 1})
    assert alone == {"memory": 16 * 3072 + reference.block_activations(2, 8, 16, 4), "traffic": 0.0}
    fsdp_tp = reference.plan_costs(block, {"pp": 1, "dp": 2, "cp": 1, "tp": 2})
    assert fsdp_tp["memory"] - reference.tp_block_activations(2, 8, 16, 4, 2) == 12288
    assert fsdp_tp["traffic"] == 3 * 4 * 3072 / 2 + 4 * 2 * 4 * 2 * 8 * 16
    # a DTensor plan of separate q, k, v: 6 tp all-reduces per layer, not 4
    unfused = reference.plan_costs(block, {"pp": 1, "dp": 2, "cp": 1, "tp": 2}, fused_qkv=False)
    assert unfused["traffic"] == 3 * 4 * 3072 / 2 + 6 * 2 * 4 * 2 * 8 * 16
    # FSDP reshards between microbatches: 2 all-gathers and 1 reduce-scatter per microbatch
    four = reference.plan_costs(block | {"microbatches": 4}, {"pp": 1, "dp": 2, "cp": 1, "tp": 2})
    assert four["traffic"] == 4 * (3 * 4 * 3072 / 2 + 4 * 2 * 4 * 2 * 8 * 16)
    assert four["memory"] == fsdp_tp["memory"]  # pp = 1: one microbatch in flight
    # cp: notebook 18's ring keeps cp score blocks, a·b·(s/cp)·s of them (÷ tp), not one block,
    # and every K/V block it received: 2·b·s·h values (÷ tp), of which s/cp are counted already
    cp_tp = reference.plan_costs(block, {"pp": 1, "dp": 1, "cp": 2, "tp": 2})
    scores = 4 * 4 * 2 * (8 // 2) * 8 / 2
    assert scores == reference.ring_score_bytes(2, 2, 4, 8) / 2
    received = 4 * 2 * 2 * (8 - 8 // 2) * 16 / 2  # the other rank's K and V, fp32, ÷ tp
    no_scores = reference.tp_block_activations(2, 4, 16, 0, 2)  # a = 0: all but the scores
    assert cp_tp["memory"] == 16 * 3072 / 4 + no_scores + scores + received
    one_block = 16 * 3072 / 4 + reference.tp_block_activations(2, 4, 16, 4, 2)
    assert cp_tp["memory"] - one_block == 4 * 4 * 2 * 4 * (8 - 4) / 2 + received
    # notebook 19, exercise 19-1 (the capacity) and the single-process layer after it
    keep = reference.moe_keep_within_capacity(torch.tensor([0, 0, 1, 0, 1, 0]), 2, 2)
    assert keep.tolist() == [True, True, True, False, True, False]
    experts = [torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)]
    x6 = torch.randn(3, 6)
    token, expert, gate = torch.tensor([0, 1, 0]), torch.tensor([0, 0, 1]), torch.rand(3)
    dense = reference.moe_dense(x6, token, expert, gate, experts)
    rows = [gate[i] * experts[int(expert[i])](x6[token[i]]) for i in range(3)]
    # The layer adds rows in another order (index_add): equal to ~1e-7 in fp32, so an absolute
    # tolerance as well; a relative one alone fails on an output near zero.
    expected_rows = torch.stack([rows[0] + rows[2], rows[1], torch.zeros(6)])
    assert torch.allclose(dense, expected_rows, atol=1e-6)
    # notebook 21, exercise 21-1: nested compute, overlapping comm, and the check's cases
    assert reference.exposed_time([(0, 4), (1, 2), (6, 8)], [(3, 7), (5, 9)]) == 3
    assert reference.exposed_time([(0, 4), (1, 3)], [(2, 6)]) == 2
    assert reference.exposed_time([(0, 10)], [(2, 5)]) == 0
    assert reference.exposed_time([(0, 2), (5, 6)], [(1, 8)]) == 5
    assert reference.exposed_time([], [(1, 3), (2, 4)]) == 3
    # notebook 20, exercise 20-1: the rows a rank reads, saved on 2 ranks, loaded on 4 or 3
    saved = [("__0_0.distcp", 0, 128), ("__1_0.distcp", 128, 128)]
    assert reference.reshard_reads(saved, 256, 4, 2) == [("__1_0.distcp", 128, 64)]
    assert reference.reshard_reads(saved, 256, 3, 1) == [("__0_0.distcp", 86, 42),
                                                         ("__1_0.distcp", 128, 44)]  # fmt: skip
    halves = [("a", 0, 32), ("b", 32, 32)]
    assert [sum(n for *_, n in reference.reshard_reads(halves, 64, 3, r)) for r in range(3)] == [
        22,
        22,
        20,
    ]
    # notebook 20, exercise 20-2: the newest complete checkpoint (numbers, not strings)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder)
        assert reference.latest_checkpoint(run / "missing") is None
        assert reference.latest_checkpoint(run) is None
        for n in (3, 9, 10, 12):
            (run / f"step_{n}").mkdir()
            if n != 12:  # step_12 is incomplete: no .metadata
                (run / f"step_{n}" / ".metadata").touch()
        assert reference.latest_checkpoint(run) == run / "step_10"
    # notebook 18, exercise 18-5: the bytes per rank behind the ratio ring / Ulysses = N / 2
    assert reference.ulysses_bytes(4) == 4 * 2 * 16 * 32 * 4 * 3 / 4
    assert reference.ring_bytes(4) == 3 * 2 * 2 * 16 * 32 * 4
    assert all(reference.ring_bytes(n) / reference.ulysses_bytes(n) == n / 2 for n in (2, 4, 8))
    # notebook 18, exercise 18-2: the score blocks a ring rank keeps, 1/N of the (b, a, s, s)
    assert reference.ring_score_bytes(4) == 2 * 4 * 64 * 64 * 4 // 4
    assert all(reference.ring_score_bytes(n) * n == 2 * 4 * 64 * 64 * 4 for n in (1, 2, 4, 8))

    def ulysses_all_to_alls():  # notebook 18, exercise 18-4 and its inverse, on each rank
        import torch
        import torch.distributed as dist

        rank = dist.get_rank()
        x = torch.arange(2 * 4 * 8 * 3, dtype=torch.float32).reshape(2, 4, 8, 3)  # (b, a, s, d)
        heads = reference.ulysses_seq_to_heads(x[:, :, 4 * rank : 4 * rank + 4])
        back = reference.ulysses_heads_to_seq(heads)
        return [torch.equal(heads, x[:, 2 * rank : 2 * rank + 2]),
                torch.equal(back, x[:, :, 4 * rank : 4 * rank + 4])]  # fmt: skip

    from nb_dist import notebook_launcher

    assert list(
        notebook_launcher(ulysses_all_to_alls, num_processes=2, init_process_group=True, timeout=60)
    ) == [[True, True], [True, True]]


# ------------------------------------------------------------------ Colab, Kaggle and Binder
REPOSITORY = "nb-dist/nb_dist"
EVERY_NOTEBOOK = sorted(NOTEBOOKS.glob("*.ipynb")) + sorted(NOTEBOOKS.glob("student/*.ipynb"))


def _first(notebook: dict, cell_type: str) -> str:
    cell = next(c for c in notebook["cells"] if c["cell_type"] == cell_type)
    return "".join(cell["source"])


@pytest.mark.parametrize("path", EVERY_NOTEBOOK, ids=lambda p: str(p.relative_to(NOTEBOOKS)))
def test_every_notebook_opens_itself_on_binder_colab_and_kaggle(path):
    """The badges under each title open that very notebook (a student edition, its own)."""
    title = _first(json.loads(path.read_text()), "markdown")
    where = path.relative_to(NOTEBOOKS.parent).as_posix()
    for url in (
        f"https://mybinder.org/v2/gh/{REPOSITORY}/HEAD?urlpath=lab/tree/{where})",
        f"https://colab.research.google.com/github/{REPOSITORY}/blob/main/{where})",
        f"https://kaggle.com/kernels/welcome?src=https://github.com/{REPOSITORY}/blob/main/{where})",
    ):
        assert url in title, f"{where}: no link {url}"


def _install_cells() -> set[str]:
    return {_first(json.loads(p.read_text()), "code") for p in EVERY_NOTEBOOK}


def test_every_notebook_starts_with_the_same_platform_install_cell():
    cells = _install_cells()
    assert len(cells) == 1, "the first code cells differ between notebooks"
    (cell,) = cells
    assert '%pip install --quiet "nb-dist @ git+https://github.com/nb-dist/nb_dist"' in cell
    assert '"COLAB_RELEASE_TAG" in os.environ or "KAGGLE_KERNEL_RUN_TYPE" in os.environ' in cell


def _run_in_ipython(code: str, **environment: str) -> subprocess.CompletedProcess[str]:
    """``code`` as a cell of a real IPython (magics and all), in a clean environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLAB_RELEASE_TAG", "KAGGLE_KERNEL_RUN_TYPE")}  # fmt: skip
    run = ("from IPython.testing.globalipapp import start_ipython\n"
           "import sys\n"
           "start_ipython().run_cell(sys.stdin.read())\n")  # fmt: skip
    return subprocess.run(
        [sys.executable, "-c", run], input=code, capture_output=True, text=True,
        env={**env, **environment}, timeout=120, check=True,
    )  # fmt: skip


def test_the_install_cell_does_nothing_off_the_platforms():
    (cell,) = _install_cells()
    done = _run_in_ipython(cell)
    assert done.stdout.strip() == "", done.stdout


@pytest.mark.parametrize("platform", ["COLAB_RELEASE_TAG", "KAGGLE_KERNEL_RUN_TYPE"])
def test_the_install_cell_runs_pip_on_colab_and_on_kaggle(platform):
    """On the platform, the cell asks pip for nb_dist: here pointed at this tree, as a dry run
    (nothing installed, no network), so that pip's answer shows the cell ran it."""
    (cell,) = _install_cells()
    here = f"nb-dist @ {NOTEBOOKS.parent.as_uri()}"
    cell = cell.replace("nb-dist @ git+https://github.com/nb-dist/nb_dist", here)
    cell = cell.replace("--quiet", "--dry-run --no-deps --no-build-isolation")
    done = _run_in_ipython(cell, **{platform: "1"})
    assert "Would install nb-dist" in done.stdout + done.stderr, done.stdout + done.stderr


# ------------------------------------------------------------------- opening and recap
TEACHING_NOTEBOOKS = sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))
#: The headings a notebook's recap (its last markdown cell) may use.
RECAP_HEADINGS = ("## What you saw",)


@pytest.mark.parametrize("path", TEACHING_NOTEBOOKS, ids=lambda p: p.stem)
def test_every_teaching_notebook_opens_with_its_plan_and_ends_with_a_recap(path):
    """The first two markdown cells hold the objectives, the prerequisites and the time in
    minutes, as paragraphs in that order; the last markdown cell is the recap."""
    markdown = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                if c["cell_type"] == "markdown"]  # fmt: skip
    opening = "\n\n".join(markdown[:2])
    starts = [re.search(rf"^\*\*{name}\.\*\* \S", opening, re.MULTILINE)
              for name in ("Objectives", "Prerequisites", "Time")]  # fmt: skip
    assert all(starts), f"{path.name}: objectives, prerequisites or time missing"
    assert [m.start() for m in starts] == sorted(m.start() for m in starts), path.name
    assert re.search(r"^\*\*Time\.\*\* About \d+ minutes", opening, re.MULTILINE), path.name
    headings = re.findall(r"^#+ .*$", markdown[-1], re.MULTILINE)
    assert headings and headings[-1] in RECAP_HEADINGS, f"{path.name}: recap {headings[-1:]}"
