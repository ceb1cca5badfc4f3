"""Browser tests: the notebooks, the widgets and the live monitor in a real JupyterLab.

How it works. A module-scoped fixture starts ``python -m jupyterlab`` (this interpreter) on
127.0.0.1, on a free port fixed up front (``--port-retries=0``), token and password off, no
browser opened, from a temporary copy of ``notebooks/`` whose stored outputs are stripped (so
only what this run rendered can satisfy a test), with temporary workspaces, user settings,
config, data and runtime folders and ``OMP_NUM_THREADS=1``; it polls ``/api/status`` until
the server answers (see ``lab_helpers.start_lab``). Kernels run this interpreter through a
``python3`` kernelspec placed first on ``JUPYTER_PATH``.

A second module-scoped fixture drives the system Chromium (``/usr/bin/chromium``, or the path in
``NB_DIST_CHROMIUM``) with Playwright for Python, headless, with
``--no-sandbox --disable-gpu --disable-quic --disable-background-networking
--disable-component-update --disable-sync --no-first-run``. It uses ``browser.launch()``, which
gives Chromium a fresh temporary profile (``--user-data-dir`` in a temp folder that Playwright
deletes on close); every test then gets its own browser context (no shared cookies or storage)
and a 1280x900 page. The Playwright *driver* ships inside the ``playwright`` wheel: never run
``playwright install``. If Chromium is missing or does not start, every test here fails (it
does not skip) with a message saying how to install it.

After each test the page's context is closed (and its renderer processes waited for) and
every kernel is shut down through the server's REST API (``DELETE /api/sessions/<id>``,
``DELETE /api/kernels/<id>``), so the autouse ``no_leftover_processes`` fixture of
``tests/conftest.py`` still holds: the server and the browser (warmed up on the lab page, so
that its GPU, network and storage helper processes exist) are started before its per-test
snapshot, kernels and renderers are not. After the last browser test the browser is closed and
the server is stopped (kernels deleted, SIGTERM), and any process left in its tree is killed.

Needs ``jupyterlab`` and ``playwright`` (Python packages) and a Chromium binary.

Run::

    python -m pytest tests/browser -m browser          # only these tests
    python -m pytest -m "not browser"                  # everything else

Screenshots of the key cells (never compared, only saved) go to ``tests/browser/artifacts/``
(git-ignored), or to the folder in ``NB_DIST_SCREENSHOTS``. To regenerate the README's
screenshots (``live_monitor.png``, ``gradient_view.png``, ``shard_explorer.png`` and a few
more)::

    NB_DIST_SCREENSHOTS=docs/screenshots python -m pytest tests/browser -m browser

A failing test also leaves ``failure-<test>.png`` (the whole page) in that folder.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_helpers import LabServer, chromium_processes, start_lab, stop_lab, wait_for_exit
from playwright.sync_api import Browser, Error, Page, sync_playwright

DEFAULT_CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VIEWPORT = {"width": 1280, "height": 900}
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each phase's report on the item, so fixtures can tell that the test failed."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


@pytest.fixture(scope="session")
def screenshots_dir() -> Path:
    """Where screenshots go: ``$NB_DIST_SCREENSHOTS`` or ``tests/browser/artifacts/``."""
    folder = Path(os.environ.get("NB_DIST_SCREENSHOTS") or ARTIFACTS).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("failure-*.png"):  # from an earlier session
        stale.unlink()
    return folder


# Module scope, not session: the server, Playwright's driver and Chromium's helper processes
# must be gone before the rest of the suite runs, whose tests each check that no process they
# did not inherit is left behind (Chromium starts helper services lazily, at any time).
@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    """A JupyterLab server for the browser tests (see ``lab_helpers.start_lab``)."""
    server = start_lab(tmp_path_factory.mktemp("jupyterlab"))
    try:
        yield server
    finally:
        stop_lab(server)


@pytest.fixture(scope="session")
def chromium_executable() -> str:
    """The Chromium executable to drive; fails (never skips) with how to install it."""
    path = os.environ.get("NB_DIST_CHROMIUM") or DEFAULT_CHROMIUM
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"Chromium not found at {path}: the browser tests need it. Install it with "
            f"`apt-get install chromium` (Debian/Ubuntu), or point NB_DIST_CHROMIUM at a "
            f"Chromium or Chrome executable. Do not run `playwright install`.",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="module")
def browser(chromium_executable: str, lab: LabServer) -> Iterator[Browser]:
    """Headless system Chromium with a fresh temporary profile, warmed up on the lab page.

    The warm-up loads JupyterLab once so that Chromium's long-lived helper processes (GPU,
    network and storage services) exist before the first test's process snapshot.
    """
    executable = chromium_executable
    playwright = sync_playwright().start()
    try:
        browser = playwright.chromium.launch(
            executable_path=executable, headless=True, args=CHROMIUM_ARGS, timeout=120_000
        )
    except Error as exc:
        problem = str(exc)
    else:
        problem = ""
    if problem:
        playwright.stop()
        pytest.fail(
            f"Chromium at {executable} did not start under Playwright: {problem}\n"
            f"Check that it runs (`{executable} --headless --no-sandbox --dump-dom about:blank`)"
            f"; install it with `apt-get install chromium` or set NB_DIST_CHROMIUM.",
            pytrace=False,
        )
    try:
        context = browser.new_context(viewport=VIEWPORT)
        page = context.new_page()
        page.goto(f"{lab.base_url}/lab?reset", timeout=120_000)
        page.locator("#jp-main-dock-panel").wait_for(timeout=120_000)
        context.close()
        yield browser
    finally:
        with contextlib.suppress(Error):
            browser.close()
        playwright.stop()
        # Nothing of Chromium may outlive the module (the per-test check in tests/conftest.py
        # tolerates the utility services Chromium starts lazily while the browser is open).
        wait_for_exit(chromium_processes(), within=20)
        left = chromium_processes()
        assert not left, f"Chromium processes left after the browser closed: {sorted(left)}"


@pytest.fixture(autouse=True)
def shut_down_kernels(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, shut down every kernel the test started (via the REST API)."""
    yield
    if "lab" in request.fixturenames:
        request.getfixturevalue("lab").shutdown_kernels()


@pytest.fixture
def page(browser: Browser, screenshots_dir: Path, request: pytest.FixtureRequest) -> Iterator[Page]:
    """A new browser context and page (1280x900) for one test; a screenshot if it failed."""
    before = chromium_processes()
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(60_000)
    page = context.new_page()
    try:
        yield page
    finally:
        report = getattr(request.node, "report_call", None)
        if report is not None and report.failed:
            name = re.sub(r"[^\w.-]+", "_", request.node.name)
            with contextlib.suppress(Exception):
                page.screenshot(path=str(screenshots_dir / f"failure-{name}.png"), full_page=True)
        context.close()
        # Its renderer processes exit a moment later; wait, so that the leftover-process
        # check after the test does not race them on a loaded machine.
        wait_for_exit(chromium_processes() - before, within=20)
