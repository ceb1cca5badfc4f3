"""The views of notebooks 13, 16 and 18 against the notebooks' own formulas, and their wiring.

The pure functions (:func:`memory_per_rank`, :func:`tp_collectives`, :func:`tp_block_bytes`,
:func:`online_softmax_steps`) are compared at several points with the functions and formulas
the notebooks define (read from the notebooks' cells) and with what the notebooks measured
(their stored outputs). The widgets are built headless (ipywidgets without a kernel): changing a
trait or a control re-renders the HTML, as a frontend would see it.
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path
from typing import Any

import nbformat
import pytest
import torch

from nb_dist.teach.reference import (
    block_activations,
    merge_blocks,
    tp_block_activations,
    tp_block_parameters,
)
from nb_dist.views import (
    MemoryExplorer,
    OnlineSoftmaxView,
    TensorParallelView,
    memory_per_rank,
    online_softmax_steps,
    tp_block_bytes,
    tp_collectives,
)
from nb_dist.views._display import SettingTypeError, SettingValueError

pytestmark = pytest.mark.fast

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def notebook_function(notebook: str, name: str, **namespace: Any) -> Any:
    """The function ``name`` as a notebook's code cell defines it (its source run alone)."""
    nb = nbformat.read(NOTEBOOKS / notebook, as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code" or f"def {name}(" not in cell.source:
            continue
        tree = ast.parse(cell.source)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                exec(ast.get_source_segment(cell.source, node), namespace)
                return namespace[name]
    raise AssertionError(f"{notebook} defines no {name}()")


def stored_output(notebook: str, startswith: str) -> str:
    """The stored text output of the code cell whose source starts with ``startswith``."""
    nb = nbformat.read(NOTEBOOKS / notebook, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith(startswith):
            return "".join(o.get("text", "") for o in cell.outputs)
    raise AssertionError(f"{notebook} has no cell starting {startswith!r}")


# ---------------------------------------------------------------- notebook 13: memory per rank

NB13 = "13_memory_of_a_training_step.ipynb"
STRATEGIES = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "TP", "PP")
MIXED = {"weights": 2, "grads": 2, "optimizer": 12, "act": 2}


@pytest.mark.parametrize(
    ("n", "layers", "h", "heads", "s", "b", "sizes"),
    [
        (2, 2, 64, 4, 32, 8, {}),  # the notebook's small case, measured there
        (8, 32, 4096, 32, 4096, 1, MIXED),  # its 8B-like model
        (8, 80, 8192, 64, 4096, 1, MIXED),  # its 70B-like model
        (3, 5, 96, 6, 40, 7, {}),  # a degree that divides nothing evenly
        (1, 1, 64, 1, 1, 1, {}),
    ],
)
def test_memory_per_rank_is_notebook_13s_per_rank(n, layers, h, heads, s, b, sizes):
    per_rank = notebook_function(
        NB13, "per_rank", block_activations=block_activations,
        tp_block_parameters=tp_block_parameters, tp_block_activations=tp_block_activations,
    )  # fmt: skip
    for strategy in STRATEGIES:
        ours = memory_per_rank(strategy, n, layers, h, heads, s, b, **sizes)
        assert ours == per_rank(strategy, n, layers, h, heads, s, b, **sizes), strategy


def test_memory_per_rank_matches_what_notebook_13_measured():
    """The small case on 2 ranks: the bytes the notebook measured for every strategy."""
    measured = stored_output(NB13, 'KINDS = ["parameters"')
    rows = re.findall(
        r"^(\S*)\s+(parameters|gradients|optimizer|activations)\s+(\d+)", measured, re.M
    )
    assert len(rows) == 20, measured  # DP, ZeRO-1, ZeRO-3, TP, PP
    strategy = ""
    for label, kind, rank0 in rows:
        strategy = label or strategy
        assert memory_per_rank(strategy, 2, 2, 64, 4, 32, 8)[kind] == int(rank0), (strategy, kind)


def test_memory_per_rank_shards_as_the_table_says():
    dp = memory_per_rank("DP", 4, 2, 64, 4, 32, 8)
    zero = {s: memory_per_rank(s, 4, 2, 64, 4, 32, 8) for s in ("ZeRO-1", "ZeRO-2", "ZeRO-3")}
    assert zero["ZeRO-1"]["optimizer"] == dp["optimizer"] / 4
    assert zero["ZeRO-2"]["gradients"] == dp["gradients"] / 4
    assert zero["ZeRO-3"]["parameters"] == dp["parameters"] / 4
    assert all(z["activations"] == dp["activations"] for z in zero.values())
    with pytest.raises(ValueError, match="strategy='FSDP'"):
        memory_per_rank("FSDP", 4, 2, 64, 4, 32, 8)


def test_memory_explorer_follows_its_traits_and_controls():
    view = MemoryExplorer(b=8, s=32, h=64, n=2)
    assert view.table() == {s: memory_per_rank(s, 2, 2, 64, 4, 32, 8) for s in STRATEGIES}
    assert "Ψ = 99,968 parameters" in repr(view)
    assert "3.967" in repr(view)  # DP's total, MB
    _ = view.widget
    before = view._html.value
    assert "b=8" in before and before.count('class="nb-dist-strategy-row"') == 6
    view.b = 9  # a trait: the HTML follows
    assert "b=9" in view._html.value and view.controls["b"].value == 9
    view.controls["n"].value = 4  # a control: the trait follows
    assert view.n == 4 and "N=4" in view._html.value
    view.controls["precision"].value = "bf16 mixed"
    assert view.table()["DP"]["optimizer"] == 12 * view.psi
    assert "bf16 mixed" in view._html.value
    view.update(s=4096, h=4096)
    assert view.controls["s"].value == 4096 and "GB" in repr(view)
    with pytest.raises(SettingValueError, match="b=0 must be >= 1"):
        view.b = 0
    with pytest.raises(SettingTypeError):
        view.h = 64.0
    with pytest.raises(SettingValueError, match="precision='fp8'"):
        view.precision = "fp8"
    assert view._repr_mimebundle_() == {"text/plain": repr(view)}  # no kernel here


# ---------------------------------------------------------------- notebook 16: f, g, SP

NB16 = "16_tensor_parallelism.ipynb"


@pytest.mark.parametrize(("b", "s", "h", "t"), [(8, 32, 64, 2), (8, 32, 64, 4), (2, 4096, 4096, 8)])
def test_tp_bytes_are_notebook_16s_formulas(b, s, h, t):
    ring_bytes = notebook_function(NB16, "ring_bytes")
    big = 4 * b * s * h
    formulas = {
        "TP": 8 * (t - 1) / t * big,
        "TP + SP": 10 * (t - 1) / t * big + 2 * (t - 1) / t * 24 * h,
    }
    for mode, formula in formulas.items():
        calls = [
            (c.phase, part, c.name, c.buffer)
            for part in ("attention", "MLP")
            for c in tp_collectives(part, mode, b, s, h, t)
        ]
        assert ring_bytes(calls, t) == pytest.approx(formula, rel=1e-12)
        assert tp_block_bytes(mode, b, s, h, t) == pytest.approx(formula, rel=1e-12)
        per_part = sum(c.sent for c in tp_collectives("MLP", mode, b, s, h, t))
        assert per_part == pytest.approx(formula / 2, rel=1e-12)


def test_tp_collectives_are_what_notebook_16_logged():
    """The names and buffers, in order, as notebook 16's collective log recorded them."""
    logged = stored_output(NB16, "show_collectives(tp_runs")
    short = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS"}
    for mode, version in (("TP", "TP, ours"), ("TP + SP", "SP, ours")):
        block = logged.split(version + " (")[1].split("\n", 1)[1]
        for phase in ("forward", "backward"):
            line = re.search(rf"^  {phase} +(.*)$", block, re.M)
            assert line is not None, block
            order = ("attention", "MLP") if phase == "forward" else ("MLP", "attention")
            ours = [
                f"{'attn' if part == 'attention' else 'mlp'} {short[c.name]} {c.buffer}"
                for part in order
                for c in tp_collectives(part, mode, 8, 32, 64, 2)
                if c.phase == phase
            ]
            assert ", ".join(ours) == line.group(1), (mode, phase)
    after = re.search(r"after backward +partial gradients AR (\d+)", logged)
    assert after is not None
    sp = [c for part in ("attention", "MLP") for c in tp_collectives(part, "TP + SP", 8, 32, 64, 2)]
    assert sum(c.buffer for c in sp if c.phase == "after backward") == int(after.group(1))


def test_tensor_parallel_view_follows_its_traits_and_controls():
    view = TensorParallelView(b=8, s=32, h=64, t=2)
    text = repr(view)
    assert "the whole block (attention + MLP): 262144 bytes" in text
    assert "reduce-scatter" not in text
    _ = view.widget
    html = view._html.value
    assert html.count("all-reduce") == 2 and "q, k, v: column-parallel" in html
    view.controls["mode"].value = "TP + SP"
    assert view.mode == "TP + SP"
    assert "reduce-scatter" in view._html.value and "(8, 16, 64)" in view._html.value
    assert "329216 bytes" in view._html.value
    view.part = "MLP"
    assert "fc1: column-parallel" in view._html.value and view.controls["part"].value == "MLP"
    view.controls["t"].value = 4
    assert view.t == 4 and "t=4" in view._html.value
    with pytest.raises(SettingValueError, match="mode='SP'"):
        view.mode = "SP"
    with pytest.raises(SettingValueError, match="t=0"):
        view.t = 0
    with pytest.raises(ValueError, match="part='embedding'"):
        tp_collectives("embedding", "TP", 1, 1, 1, 1)


# ---------------------------------------------------------------- notebook 18: online softmax


def scores_and_values(s=64, d=8, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(s, generator=g), torch.randn(s, d, generator=g)


@pytest.mark.parametrize(("block", "scale"), [(16, 1.0), (10, 1.0), (1, 1.0), (64, 1.0), (8, 30.0)])
def test_online_softmax_steps_end_at_the_softmax(block, scale):
    x, v = scores_and_values(scale=scale)
    steps = online_softmax_steps(x, v, block, merge_blocks)
    assert len(steps) == math.ceil(64 / block)
    assert [st.keys[0] for st in steps] == list(range(0, 64, block))
    for st in steps:  # the running state is the softmax over the keys seen so far
        seen = x[: st.keys[1]]
        assert st.m == float(seen.max())
        assert st.den == pytest.approx(float(torch.exp(seen - seen.max()).sum()), rel=1e-5)
        expected = torch.softmax(seen, 0) @ v[: st.keys[1]]
        assert torch.allclose(torch.tensor(st.output), expected, atol=1e-5)
    assert all(math.isfinite(st.den) for st in steps)  # scores x30: no overflow


def test_online_softmax_uses_notebook_18s_block_state():
    """Each block's (m, den, acc) as the notebook's ``block_attention`` computes it."""
    block_attention = notebook_function(
        "18_context_parallelism.ipynb", "block_attention", math=math, torch=torch
    )
    x, v = scores_and_values()
    q, k = x[None, :], torch.eye(64)  # q kᵀ/√64 = x/8: scale the scores back up
    m, den, acc = block_attention(8 * q, k[:16], v[:16])
    first = online_softmax_steps(x, v, 16, merge_blocks)[0]
    assert first.m == pytest.approx(float(m), rel=1e-6)
    assert first.den == pytest.approx(float(den), rel=1e-6)
    assert torch.allclose(torch.tensor(first.acc), acc[0], atol=1e-6)


def test_online_softmax_view_follows_its_traits_and_controls():
    x, v = scores_and_values()
    view = OnlineSoftmaxView(x, v, merge_blocks, block=16)
    assert view.step == 1 and view.num_blocks == 4
    assert "block 0 (keys 0-15)" in repr(view) and "3 block(s) to go" in repr(view)
    _ = view.widget
    assert view._html.value.count('class="nb-dist-softmax-step"') == 1
    view.controls["step"].value = 2  # a control: the trait and the HTML follow
    assert view.step == 2 and "block 1 (keys 16-31)" in view._html.value
    view.go_to(4)
    assert view.controls["step"].value == 4 and "equals softmax" in view._html.value
    assert view.matches() and "(atol=1e-6): True" in repr(view)
    view.block = 32  # fewer blocks: the step and the slider's end follow
    assert view.step == 2 and view.controls["step"].max == 2
    view.controls["block"].value = 8
    assert view.num_blocks == 8 and view.controls["step"].max == 8 and view.step == 2
    with pytest.raises(SettingValueError, match="step=9"):
        view.step = 9
    with pytest.raises(ValueError, match="one value per key"):
        OnlineSoftmaxView(x, v[:10], merge_blocks)
