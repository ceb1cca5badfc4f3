"""Training libraries' own code runs in a rank as it does under torchrun.

``docs/frameworks.md``'s recipes run as written in a real kernel, against the real packages
(CI installs them: the ``frameworks`` extra). Lightning gets more: ``import lightning`` in an
earlier cell (its interactive flag then says "console"), ``strategy="ddp"`` in a launch and in
live ranks, and a ``devices`` mismatch; the flags nb_dist clears have a canary each
(``nb_dist/_rank/_frameworks.py``). A package that cannot be installed here is skipped with
the reason.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kernel_helpers import execute

from nb_dist._kernel._diagnosis import framework_hint
from nb_dist._rank._frameworks import FROZEN

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "frameworks.md").read_text()
RECIPE = re.compile(r"<!-- recipe: ([\w-]+) -->\n```python\n(.*?)```", re.S)
RECIPES = dict(RECIPE.findall(DOC))

#: Why a package may be missing: the reason a test skips with.
MISSING = {
    "lightning": "lightning is not installed (pip install -e '.[frameworks]')",
    "transformers": "transformers is not installed (pip install -e '.[frameworks]')",
    "accelerate": "accelerate is not installed (pip install -e '.[test]')",
    "fastai": "fastai needs torchvision, whose PyPI wheels do not import beside the local "
    "CPU build of torch (torch==2.13.0) that CI installs",
}


def _needs(package: str) -> None:
    pytest.importorskip(package, reason=MISSING[package], exc_type=ImportError)


def _run_recipe(kc, name: str) -> None:
    execute(kc, RECIPES[name], timeout=220).expect_ok()


def test_every_recipe_in_the_doc_is_run_here():
    assert set(RECIPES) == {
        "lightning-fabric", "lightning-trainer", "transformers-trainer", "accelerate",
        "torchrun-script", "fastai",
    }  # fmt: skip
    readme = (ROOT / "README.md").read_text()
    assert "docs/frameworks.md" in readme


# ----------------------------------------------------------------------------- Lightning
def test_lightning_fabric_ddp_after_import_lightning_in_an_earlier_cell(kernels):
    _needs("lightning")
    _, kc = kernels()
    execute(kc, "import lightning as L", timeout=120).expect_ok()
    # The kernel is an interactive console to Lightning: what made strategy="ddp" refuse.
    flag = execute(kc, "L.fabric.utilities.imports._IS_INTERACTIVE").expect_ok()
    assert flag.result_text == "True"
    _run_recipe(kc, "lightning-fabric")
    check = execute(kc, "len(result), result[0] == result[1]").expect_ok()
    assert check.result_text == "(2, True)"
    # devices=4 on 2 ranks: Lightning's own message, then nb_dist's line.
    code = textwrap.dedent(
        """
        def four_devices():
            L.Fabric(accelerator="cpu", devices=4, strategy="ddp").launch()
        notebook_launcher(four_devices, num_processes=2)
        """
    )
    failed = execute(kc, code, timeout=120)
    assert failed.error is not None and failed.error["ename"] == "WorkerFailedError"
    text = failed.error_text()
    assert "does not match the world size (2)" in text, text
    assert "nb_dist: the launch started 2 rank(s)" in text and "pass devices=2" in text
    # The kernel is usable after the failure.
    _run_recipe(kc, "lightning-fabric")


def test_lightning_trainer_ddp_fits_on_two_ranks(kernels, tmp_path):
    _needs("lightning")
    _, kc = kernels()
    execute(kc, "import lightning", timeout=120).expect_ok()
    _run_recipe(kc, "lightning-trainer")
    check = execute(kc, "len(result), result[0] == result[1]").expect_ok()
    assert check.result_text == "(2, True)"


def test_lightning_fabric_ddp_in_live_ranks(kernels):
    _needs("lightning")
    _, kc = kernels()
    execute(kc, "import lightning as L, torch, nb_dist\n%load_ext nb_dist", timeout=120)
    execute(kc, "ranks = nb_dist.Ranks(2)").expect_ok()
    cell = textwrap.dedent(
        """\
        %%ranks
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
        fabric.launch()
        model = torch.nn.Linear(4, 1)
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        (fabric.world_size, fabric.global_rank)
        """
    )
    run = execute(kc, cell, timeout=120).expect_ok()
    assert run.result_text == "[rank 0] (2, 0)\n[rank 1] (2, 1)"
    execute(kc, "ranks.close()").expect_ok()


def test_a_rank_clears_lightnings_interactive_flag_and_the_prompt(tmp_path):
    """In a real process that imported Lightning as a console (sys.ps1 set)."""
    _needs("lightning")
    script = textwrap.dedent(
        """
        import sys
        sys.ps1 = ">>> "
        import lightning  # computes _IS_INTERACTIVE = True and copies it around
        import lightning.pytorch
        from nb_dist._rank._frameworks import become_a_script
        copies = [m for m in list(sys.modules.values())
                  if getattr(m, "_IS_INTERACTIVE", None) is True]
        assert len(copies) >= 2, copies
        changed = become_a_script()
        assert not hasattr(sys, "ps1")
        assert not [m for m in list(sys.modules.values())
                    if getattr(m, "_IS_INTERACTIVE", None) is True]
        assert "lightning.fabric.utilities.imports._IS_INTERACTIVE" in changed, changed
        assert become_a_script() == []  # nothing left to do
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


@pytest.mark.parametrize("flag", FROZEN, ids=lambda f: f"{f.defined_in}.{f.name}")
def test_canary_each_frozen_flag_is_where_nb_dist_clears_it(flag):
    """Fails on a release that moved or dropped the flag: update ``_frameworks.FROZEN``."""
    _needs(flag.packages[0])
    import importlib

    module = importlib.import_module(flag.defined_in)
    assert isinstance(getattr(module, flag.name), bool)


def test_the_hint_for_lightnings_world_size_message():
    message = (
        "You set `devices=4` and `num_nodes=1` in Lightning, but the product (4 * 1) does not "
        "match the world size (2)."
    )
    assert framework_hint(message) == (
        "nb_dist: the launch started 2 rank(s); Lightning's devices x num_nodes must equal "
        "that: pass devices=2 (or launch with num_processes=4)."
    )
    assert framework_hint("RuntimeError: something else") is None


# ----------------------------------------------------------------------------- the others
@pytest.mark.parametrize(
    ("recipe", "package"),
    [("transformers-trainer", "transformers"), ("accelerate", "accelerate"), ("fastai", "fastai")],
)
def test_a_recipe_trains_the_same_parameters_on_both_ranks(kernels, recipe, package):
    _needs(package)
    _, kc = kernels()
    _run_recipe(kc, recipe)
    check = execute(kc, "len(result), result[0] == result[1]").expect_ok()
    assert check.result_text == "(2, True)"


def test_torchrun_script_recipe(kernels):
    _, kc = kernels()
    run = execute(kc, RECIPES["torchrun-script"], timeout=120).expect_ok()
    sums = dict(re.findall(r"\[rank (\d)\] rank \d weight sum (-?[\d.]+)", run.stdout()))
    assert set(sums) == {"0", "1"} and sums["0"] == sums["1"], run.stdout()
    assert execute(kc, "list(result)").expect_ok().result_text == "[0, 0]"
