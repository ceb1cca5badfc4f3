"""Shared fixtures: every test that launches must leave no process of its launch behind, and
every Jupyter kernel a test starts (``kernels``, ``module_kernels``) is shut down and must
leave nothing behind either."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from kernel_helpers import RunningKernel, execute, start_kernel
from process_helpers import assert_all_gone

# The must-fail notebook is run on purpose by test_notebook_harness.py, never collected here.
collect_ignore = ["broken_notebooks"]

# Keep ranks cheap on 2-core CI machines.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _descendants() -> dict[int, str]:
    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                found[child.pid] = " ".join(child.cmdline()[:4])
        except psutil.Error:
            pass
    return found


def _is_helper(cmdline: str) -> bool:
    # multiprocessing's long-lived helpers (forkserver, resource tracker) are not workers.
    # Chromium (tests/browser) starts utility services lazily, whenever it likes; they belong
    # to the browser, whose module-scoped fixture closes it and checks that nothing is left.
    chromium_service = "chrom" in cmdline and "--type=utility" in cmdline
    return "forkserver" in cmdline or "resource_tracker" in cmdline or chromium_service


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail the test if a process it started is still alive 3 s after it ended."""
    before = set(_descendants())
    yield
    deadline = time.monotonic() + 3
    left = {}
    while time.monotonic() < deadline:
        left = {
            pid: cmd
            for pid, cmd in _descendants().items()
            if pid not in before and not _is_helper(cmd)
        }
        if not left:
            return
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    pytest.fail(f"processes left behind by this test: {left}")


# ----------------------------------------------------------------------------- Jupyter kernels
class KernelFactory:
    """Starts real kernels (ipykernel, driven with jupyter_client) for one test or one module.

    ``factory(workdir=None, env=None)`` starts one and returns its :class:`RunningKernel`
    (``km, kc = factory()``): the first in the fixture's folder, any further one in a folder
    of its own. At the end every kernel still up is shut down, and the kernel and every
    process it had started (workers, live ranks, their helpers) must be gone: killing the
    kernel takes its workers along, or the test fails.
    """

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._started: list[RunningKernel] = []

    def __call__(
        self, workdir: Path | None = None, env: dict[str, str] | None = None
    ) -> RunningKernel:
        if workdir is None:
            n = len(self._started)
            workdir = self._folder if n == 0 else self._folder / f"kernel-{n + 1}"
        km, kc = start_kernel(workdir, env)
        kernel = RunningKernel(km, kc)
        self._started.append(kernel)
        return kernel

    def close(self) -> None:
        left: list[int] = []
        errors: list[Exception] = []
        for kernel in self._started:
            try:
                left += kernel.stop()
            except Exception as exc:  # stop the others all the same
                errors.append(exc)
        assert_all_gone(left)
        if errors:
            raise errors[0]


def _kernel_factory(folder: Path) -> Iterator[Callable[..., RunningKernel]]:
    factory = KernelFactory(folder)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def kernels(tmp_path: Path) -> Iterator[Callable[..., RunningKernel]]:
    """Start kernels for this test (the first one in ``tmp_path``); see :class:`KernelFactory`."""
    yield from _kernel_factory(tmp_path)


@pytest.fixture(scope="module")
def module_kernels(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Callable[..., RunningKernel]]:
    """Start kernels shared by a module's tests; see :class:`KernelFactory`."""
    yield from _kernel_factory(tmp_path_factory.mktemp(request.module.__name__))


def set_up(kernel: RunningKernel, module: object) -> RunningKernel:
    """Run the test module's ``KERNEL_SETUP`` (a cell, or a tuple of cells) in ``kernel``."""
    setup = getattr(module, "KERNEL_SETUP", ())
    _, kc = kernel
    for cell in (setup,) if isinstance(setup, str) else setup:
        execute(kc, cell, timeout=90).expect_ok()
    return kernel


@pytest.fixture
def kernel(kernels: Callable[..., RunningKernel], request: pytest.FixtureRequest) -> RunningKernel:
    """A fresh kernel for this test (in ``tmp_path``), set up by its module's
    ``KERNEL_SETUP``: ``km, kc = kernel``."""
    return set_up(kernels(), request.module)


@pytest.fixture(scope="module")
def module_kernel(
    module_kernels: Callable[..., RunningKernel], request: pytest.FixtureRequest
) -> RunningKernel:
    """One kernel for the module's tests that leave it usable, set up once by the module's
    ``KERNEL_SETUP``: ``km, kc = module_kernel``."""
    return set_up(module_kernels(), request.module)
