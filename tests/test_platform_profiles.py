"""The platform profiles of .ci/run: their files, the floors they hold, and the check that pip
changed none of a platform's packages (run here against this very environment)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast

PLATFORMS = Path(__file__).resolve().parent.parent / ".ci" / "platforms"
PYPROJECT = PLATFORMS.parent.parent / "pyproject.toml"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, PLATFORMS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _profile(name: str) -> tuple[str, dict[str, str]]:
    text = (PLATFORMS / f"{name}.txt").read_text()
    python = re.search(r"^# python-version: (\d+\.\d+)$", text, re.MULTILINE)
    assert python, f"{name}.txt names no python-version"
    pins = dict(line.split("==") for line in text.splitlines() if "==" in line)
    return python[1], pins


@pytest.mark.parametrize(("name", "python"), [("kaggle", "3.12"), ("colab", "3.13")])
def test_a_profile_pins_the_platforms_kernel_stack(name, python):
    found_python, pins = _profile(name)
    assert found_python == python
    for package in ("torch", "ipykernel", "ipython", "ipywidgets", "traitlets", "jupyter-client",
                    "matplotlib", "cloudpickle", "psutil", "accelerate", "pytest"):  # fmt: skip
        assert package in pins, f"{name}.txt lacks {package}"
    assert pins["ipykernel"] == "6.17.1" and pins["ipython"] == "7.34.0", pins


def _floors() -> dict[str, Version]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    floors = {}
    for line in project["dependencies"]:
        requirement = Requirement(line)
        (spec,) = [s for s in requirement.specifier if s.operator == ">="]
        floors[re.sub(r"[-_.]+", "-", requirement.name).lower()] = Version(spec.version)
    return floors


@pytest.mark.parametrize("name", ["kaggle", "colab"])
def test_every_floor_is_at_or_below_the_platforms_version(name):
    """Otherwise `pip install nb_dist` there replaces a package of the runtime."""
    _, pins = _profile(name)
    for package, floor in _floors().items():
        assert package in pins, f"{name}.txt has no {package}: every dependency is a platform's"
        assert floor <= Version(pins[package]), (
            f"{package}>={floor} is above {name}'s {pins[package]}"
        )


def test_the_kernel_stacks_floors_are_kaggles_versions():
    """The floors are what CI tests in the Kaggle profile, not lower guesses."""
    _, pins = _profile("kaggle")
    floors = _floors()
    for package in ("torch", "ipykernel", "ipython", "ipywidgets", "traitlets"):
        assert floors[package] == Version(pins[package]), package


def test_a_freeze_is_read_as_pins_of_released_versions(tmp_path):
    make_profile = _script("make_profile")
    freeze = tmp_path / "freeze.txt"
    freeze.write_text(
        "torch==2.11.0+cu128\n"
        "Jupyter_Client==7.4.9\n"
        "-e git+https://example.invalid/x.git#egg=x\n"
        "google-colab @ file:///colabtools/dist/google_colab-1.0.0.tar.gz\n"
        "nvidia-nccl-cu12==2.28.9\n"
        "# a comment\n"
    )
    pins = make_profile.read_freeze(str(freeze))
    assert pins == {"torch": "2.11.0", "jupyter-client": "7.4.9", "nvidia-nccl-cu12": "2.28.9"}
    # The CUDA libraries follow the index's build of torch, not the platform's pins.
    assert make_profile.index_pins(pins) == {"torch": "2.11.0", "jupyter-client": "7.4.9"}


def _unchanged(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PLATFORMS / "unchanged.py"), *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_the_check_passes_when_nothing_changed(tmp_path):
    record = tmp_path / "platform.txt"
    assert _unchanged("--record", str(record)).returncode == 0
    assert f"pytest=={metadata.version('pytest')}\n" in record.read_text()
    done = _unchanged(str(record), "--after", "pip install nb_dist")
    assert done.returncode == 0, done.stderr


def test_the_check_fails_naming_each_package_pip_changed(tmp_path):
    record = tmp_path / "platform.txt"
    record.write_text(
        f"pytest==0.0.1\nno-such-package==1.0\npackaging=={metadata.version('packaging')}\n"
    )
    done = _unchanged(str(record), "--after", "pip install nb_dist")
    assert done.returncode == 1
    assert "pip install nb_dist changed 2 of the platform's packages:" in done.stderr
    assert f"pytest: 0.0.1 -> {metadata.version('pytest')}" in done.stderr
    assert "no-such-package: 1.0 -> removed" in done.stderr
    assert "packaging" not in done.stderr.split("packages:")[1].split("On the platform")[0]
    assert "Lower the requirement in pyproject.toml" in done.stderr
