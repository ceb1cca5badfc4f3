"""The README's set-up commands are the ones that work everywhere, and CI runs its test command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _first_block_after(heading: str) -> list[str]:
    section = README[README.index(heading) :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"no bash block after {heading!r}"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_set_up_commands_need_only_the_default_index():
    """A second index made pip retry for ten minutes where only the default one is
    reachable (mirrors, air-gapped labs, CI); the CPU-only tip is a note under the commands."""
    commands = _first_block_after("## Install and run")
    assert commands == ["pip install -e . && nb-dist demo", "bash .ci/run"]


def test_ci_runs_the_readmes_test_command_on_the_pinned_set():
    assert _first_block_after("## Tests") == ["python -m pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\npython -m pytest\n" in ci
    assert '-c "$constraints"' in ci
    pins = (ROOT / ".ci" / "constraints.txt").read_text().splitlines()
    pinned = {line.split("==")[0].lower() for line in pins if "==" in line}
    for name in ("torch", "ipykernel", "ipython", "cloudpickle", "nbval", "jupyterlab"):
        assert name in pinned, f".ci/constraints.txt does not pin {name}"
