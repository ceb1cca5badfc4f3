"""The Binder environment matches what CI tests: same torch, the package installed, one thread."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]


def _binder_torch() -> Version:
    lines = (ROOT / "binder" / "requirements.txt").read_text().splitlines()
    pins = [line for line in lines if line.startswith("torch==")]
    assert len(pins) == 1, f"binder/requirements.txt must pin torch exactly once: {pins}"
    return Version(pins[0].split("==", 1)[1])


def test_binder_pins_the_torch_version_ci_installs():
    """binder/requirements.txt pins torch to the version .ci/run installs."""
    ci = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"^pinned_torch=([0-9][^\s]*)$", ci, re.MULTILINE)
    assert match, ".ci/run must install a pinned torch (pinned_torch=...)"
    assert _binder_torch() == Version(match.group(1))


def test_binder_torch_satisfies_the_package_requirement():
    """The pinned torch is inside pyproject's torch range (so pip keeps it)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_req = next(Requirement(r) for r in project["dependencies"] if r.startswith("torch"))
    assert _binder_torch() in torch_req.specifier


def test_binder_uses_the_cpu_index():
    """The CPU wheel index keeps Binder from pulling the CUDA build."""
    text = (ROOT / "binder" / "requirements.txt").read_text()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in text


def test_binder_installs_the_package_and_uses_one_thread_per_rank():
    """postBuild installs this repository; start sets OMP_NUM_THREADS=1."""
    post_build = (ROOT / "binder" / "postBuild").read_text()
    assert re.search(r"pip install .*-e \.", post_build)
    start = (ROOT / "binder" / "start").read_text()
    assert "export OMP_NUM_THREADS=1" in start and 'exec "$@"' in start


def test_readme_binder_link_opens_the_quickstart():
    """The README's Binder badge opens JupyterLab at a notebook that exists."""
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"mybinder\.org/v2/gh/[^)\s]+\?urlpath=lab/tree/([^)\s]+)", readme)
    assert match, "README must link to mybinder with urlpath=lab/tree/<notebook>"
    assert (ROOT / match.group(1)).is_file()


def test_binder_installs_what_the_notebooks_import():
    """Every third-party package a notebook imports is installed on Binder."""
    import json

    provided = {"torch", "nb_dist", "matplotlib", "ipywidgets", "IPython", "numpy", "accelerate"}
    binder = (ROOT / "binder" / "requirements.txt").read_text()
    assert "accelerate" in binder
    # Imported under try/except: the notebook says how to get them. Ray's local 2-node
    # cluster (notebook 07, section 5) needs more memory than Binder gives a notebook.
    optional = {"transformers", "ray"}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        for match in re.finditer(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", code, re.M):
            name = match.group(1)
            if name in sys.stdlib_module_names or name in provided | optional:
                continue
            if f"{name}.py" in code:  # a module the notebook writes itself
                continue
            raise AssertionError(f"{path.name} imports {name}, which Binder does not install")
