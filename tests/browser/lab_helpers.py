"""A real JupyterLab server for the browser tests, and helpers that drive its page.

The server runs this interpreter (`python -m jupyterlab`) on loopback from a temporary copy of
``notebooks/`` with every stored output removed, so whatever the tests find in the page was
rendered by this run. Its kernels use this interpreter too: a ``python3`` kernelspec written to
a temporary ``JUPYTER_PATH`` entry (searched before every other kernel folder) runs
``sys.executable -m ipykernel_launcher``, and the server's environment has
``OMP_NUM_THREADS=1``. User settings (no news toast, every cell attached to the DOM), config,
runtime and data folders are temporary as well, so nothing on the machine changes what runs.

The page helpers use the real UI where it matters (the Run menu, the toolbar's buttons, the
widgets' own controls) and wait on conditions in the DOM, each with a deadline and a message
that says what was still missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import psutil
from playwright.sync_api import Locator, Page

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

# JupyterLab user settings for the test server: no news/update toast over the page, and every
# cell attached to the DOM (the default windowing can detach cells outside the viewport), and
# kernels started without asking.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none",
        # Start the notebook's kernel without a "Select Kernel" dialog, even when the page
        # asks before it has loaded the kernelspecs (seen under load).
        "autoStartDefaultKernel": True,
    },
}

# A prompt shows `[7]:` once its cell ran, `[*]:` while queued or running, `[ ]:` before.
_EXECUTED_PROMPT = re.compile(r"^\[\d+\]:?$")


# --------------------------------------------------------------------------- the server
def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the server gets --port-retries=0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def copy_notebooks_without_outputs(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target``, dropping stored outputs, execution counts and widget state.

    A test can then only find output that the live kernel produced and the browser rendered.
    """
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for path in target.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs = []
                cell.execution_count = None
        nb.metadata.pop("widgets", None)
        nbformat.write(nb, path)


def write_kernelspec(data_dir: Path) -> None:
    """A ``python3`` kernelspec running this interpreter, in a JUPYTER_PATH data folder."""
    spec_dir = data_dir / "kernels" / "python3"
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
        "metadata": {"debugger": False},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1))


def write_lab_settings(settings_dir: Path) -> None:
    """JupyterLab user settings (see ``LAB_SETTINGS``) in a fresh user-settings folder."""
    for name, values in LAB_SETTINGS.items():
        path = settings_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@dataclass
class LabServer:
    """A running ``jupyter lab`` process and the folders it was given."""

    process: subprocess.Popen[bytes]
    base_url: str
    root_dir: Path
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log, for failure messages."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no server log: {exc})"

    def api(self, method: str, path: str, timeout: float = 30) -> Any:
        """Call the server's REST API; returns the decoded JSON body (None when empty)."""
        request = urllib.request.Request(self.base_url + path, method=method)
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
        return json.loads(body) if body else None

    def kernel_ids(self) -> list[str]:
        return [kernel["id"] for kernel in self.api("GET", "/api/kernels")]

    def shutdown_kernels(self, within: float = 60) -> None:
        """Delete every session and kernel through the REST API and wait until none is left."""
        for session in self.api("GET", "/api/sessions"):
            with contextlib.suppress(urllib.error.HTTPError):
                self.api("DELETE", f"/api/sessions/{session['id']}", timeout=within)
        for kernel_id in self.kernel_ids():
            with contextlib.suppress(urllib.error.HTTPError):
                self.api("DELETE", f"/api/kernels/{kernel_id}", timeout=within)
        deadline = time.monotonic() + within
        while self.kernel_ids():
            if time.monotonic() > deadline:
                raise AssertionError(f"kernels still listed {within} s after DELETE")
            time.sleep(0.1)


def start_lab(workdir: Path, ready_within: float = 120) -> LabServer:
    """Start JupyterLab on 127.0.0.1 from a copy of ``notebooks/`` and wait for /api/status."""
    root = workdir / "notebooks"
    copy_notebooks_without_outputs(NOTEBOOKS, root)
    write_kernelspec(workdir / "jupyter-data")
    write_lab_settings(workdir / "lab-user-settings")
    port = free_port()
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        JUPYTER_PATH=str(workdir / "jupyter-data"),  # searched first: our python3 kernelspec
        JUPYTER_DATA_DIR=str(workdir / "jupyter-user-data"),
        JUPYTER_CONFIG_DIR=str(workdir / "jupyter-config"),
        JUPYTER_RUNTIME_DIR=str(workdir / "jupyter-runtime"),
        JUPYTER_PLATFORM_DIRS="0",
    )
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--port={port}",
        "--port-retries=0",
        "--IdentityProvider.token=",
        "--ServerApp.password=",
        "--ServerApp.disable_check_xsrf=True",
        "--ServerApp.terminals_enabled=False",
        f"--ServerApp.root_dir={root}",
        "--LabApp.expose_app_in_browser=True",
        f"--LabApp.workspaces_dir={workdir / 'lab-workspaces'}",
        f"--LabApp.user_settings_dir={workdir / 'lab-user-settings'}",
        "--LabApp.extension_manager=readonly",  # no PyPI queries
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")  # CI containers often run as root
    log_path = workdir / "jupyter-lab.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT)
    server = LabServer(process, f"http://127.0.0.1:{port}", root, log_path)
    deadline = time.monotonic() + ready_within
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"jupyter lab exited with code {process.returncode} before it was ready:\n"
                f"{server.log_tail()}"
            )
        with contextlib.suppress(OSError, ValueError):
            if "started" in server.api("GET", "/api/status", timeout=2):
                return server
        if time.monotonic() > deadline:
            stop_lab(server)
            raise RuntimeError(
                f"jupyter lab did not answer /api/status within {ready_within} s:\n"
                f"{server.log_tail()}"
            )
        time.sleep(0.2)


def stop_lab(server: LabServer, within: float = 30) -> None:
    """Shut kernels down, stop the server (SIGTERM), then kill whatever of its tree is left."""
    tree: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        process = psutil.Process(server.process.pid)
        tree = [process, *process.children(recursive=True)]
    with contextlib.suppress(OSError, urllib.error.URLError, AssertionError):
        if server.process.poll() is None:
            server.shutdown_kernels(within=within)
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(within)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(10)
    _, alive = psutil.wait_procs(tree, timeout=5)
    for leftover in alive:
        with contextlib.suppress(psutil.Error):
            leftover.kill()
    psutil.wait_procs(alive, timeout=5)


# --------------------------------------------------------------------------- the browser
def chromium_processes() -> set[int]:
    """Pids of this test process's descendants that belong to Chromium (or Chrome)."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "chrom" in child.name().lower() and child.status() != psutil.STATUS_ZOMBIE:
                found.add(child.pid)
    return found


def wait_for_exit(pids: set[int], within: float) -> None:
    """Wait up to ``within`` s for ``pids`` to exit (what is left is reported elsewhere)."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    psutil.wait_procs(procs, timeout=within)


def kernel_ranks(lab: LabServer) -> list[psutil.Process]:
    """The live child processes of the server's only kernel: a launch's ranks."""
    kernels = [
        p
        for p in psutil.Process(lab.process.pid).children()
        if "ipykernel_launcher" in " ".join(p.cmdline())
    ]
    assert len(kernels) == 1, f"expected one kernel, found {kernels}"
    return [p for p in kernels[0].children() if p.status() != psutil.STATUS_ZOMBIE]


def wait_for_no_ranks(lab: LabServer, within: float) -> None:
    """Wait until the kernel has no rank processes left."""
    deadline = time.monotonic() + within
    while kernel_ranks(lab):
        if time.monotonic() > deadline:
            raise AssertionError(f"ranks still alive {within} s later: {kernel_ranks(lab)}")
        time.sleep(0.1)


# --------------------------------------------------------------------------- the page
def open_notebook(page: Page, server: LabServer, name: str, within: float = 120) -> Locator:
    """Open ``name`` in a reset workspace; return its panel once its kernel is idle."""
    page.goto(f"{server.base_url}/lab/tree/{name}?reset", timeout=within * 1000)
    panel = page.locator(".jp-NotebookPanel")
    panel.first.wait_for(timeout=within * 1000)
    wait_for_kernel_idle(page, server, name, within)
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")  # same width every time
    return panel.first


def wait_for_kernel_idle(page: Page, server: LabServer, name: str, within: float) -> None:
    """Wait until the server has an idle kernel for notebook ``name`` and the page shows it.

    Fails at once if JupyterLab opened a dialog (e.g. "Select Kernel") instead.
    """
    deadline = time.monotonic() + within
    indicator = page.locator('.jp-NotebookPanel-toolbar [data-status="idle"]')
    states: list[str] = []
    while time.monotonic() < deadline:
        dialog = page.locator(".jp-Dialog")
        if dialog.count():
            raise AssertionError(f"JupyterLab shows a dialog: {dialog.first.inner_text()!r}")
        states = [
            session["kernel"]["execution_state"]
            for session in server.api("GET", "/api/sessions")
            if session["path"] == name and session.get("kernel")
        ]
        if states == ["idle"] and indicator.count():
            return
        time.sleep(0.25)
    raise AssertionError(f"no idle kernel for {name} within {within} s (server says {states})")


def run_menu_item(page: Page, label: str) -> None:
    """Click the menu bar's Run menu, then its item labelled exactly ``label``."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    item = page.locator(".lm-Menu-item").filter(
        has=page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(label)}$"))
    )
    item.wait_for()
    item.click()


def toolbar_button(page: Page, command: str) -> Locator:
    """The notebook panel toolbar's button for ``command`` (e.g. notebook:interrupt-kernel)."""
    return page.locator(f'.jp-NotebookPanel-toolbar jp-button[data-command="{command}"]')


def run_all_cells(page: Page, started_within: float = 30) -> None:
    """Run > Run All Cells, as a user would; wait until the first cell is queued or ran."""
    run_menu_item(page, "Run All Cells")
    deadline = time.monotonic() + started_within
    while time.monotonic() < deadline:
        prompts, _ = cell_states(page)
        if any(p.strip("[]: ") for p in prompts):
            return
        time.sleep(0.1)
    raise AssertionError(f"Run All Cells ran nothing within {started_within} s: {prompts}")


_CELL_STATE_JS = """
() => {
  const cells = [...document.querySelectorAll('.jp-NotebookPanel-notebook .jp-CodeCell')];
  const prompts = cells.map(c => (c.querySelector('.jp-InputPrompt')?.textContent || '').trim());
  const status = document.querySelector('.jp-NotebookPanel-toolbar [data-status]');
  return {prompts, status: status ? status.dataset.status : null};
}
"""


def cell_states(page: Page) -> tuple[list[str], str | None]:
    """Every code cell's prompt text and the kernel indicator's status."""
    state = page.evaluate(_CELL_STATE_JS)
    return state["prompts"], state["status"]


def wait_until_all_executed(page: Page, within: float, settle: float = 3.0) -> None:
    """Wait until every code cell shows an execution count and the kernel is idle.

    Fails early (after ``settle`` s of a stable idle state with unexecuted cells) when a cell
    raised and JupyterLab dropped the rest of the queue, quoting the error output.
    """
    deadline = time.monotonic() + within
    stuck_since: float | None = None
    while True:
        prompts, status = cell_states(page)
        done = [bool(_EXECUTED_PROMPT.match(p)) for p in prompts]
        running = any("*" in p for p in prompts)
        if status == "idle" and prompts and all(done):
            return
        if status == "idle" and not running:
            stuck_since = stuck_since or time.monotonic()
            if time.monotonic() - stuck_since > settle:
                raise AssertionError(
                    f"the kernel is idle but cells {[i for i, d in enumerate(done) if not d]} "
                    f"never ran (prompts {prompts}); errors shown:\n{error_outputs(page)}"
                )
        else:
            stuck_since = None
        if time.monotonic() > deadline:
            raise AssertionError(
                f"cells still running after {within} s: prompts {prompts}, kernel {status}"
            )
        time.sleep(0.25)


def error_outputs(page: Page) -> str:
    """Text of every traceback rendered in the notebook (for failure messages)."""
    stderr = '[data-mime-type="application/vnd.jupyter.stderr"]'
    errors = page.locator(f".jp-NotebookPanel-notebook .jp-OutputArea-output{stderr}")
    return "\n---\n".join(errors.all_inner_texts())


def code_cell(page: Page, source_snippet: str) -> Locator:
    """The one code cell whose source contains ``source_snippet``."""
    cells = page.locator(".jp-NotebookPanel-notebook .jp-CodeCell").filter(
        has=page.locator(".jp-InputArea-editor", has_text=source_snippet)
    )
    count = cells.count()
    assert count == 1, f"{count} code cells contain {source_snippet!r}"
    return cells.first


def code_cells(page: Page) -> Locator:
    """All code cells of the open notebook, in order."""
    return page.locator(".jp-NotebookPanel-notebook .jp-CodeCell")


def output_text(cell: Locator) -> str:
    """The rendered text of every output of ``cell``."""
    return "\n".join(cell.locator(".jp-OutputArea-output").all_inner_texts())


def wait_for_text(locator: Locator, pattern: str | re.Pattern[str], within: float) -> str:
    """Wait until ``locator``'s inner text matches ``pattern``; return the text."""
    regex = re.compile(re.escape(pattern)) if isinstance(pattern, str) else pattern
    deadline = time.monotonic() + within
    text = ""
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            text = "\n".join(locator.all_inner_texts())
            if regex.search(text):
                return text
        time.sleep(0.2)
    raise AssertionError(f"{regex.pattern!r} did not appear within {within} s; text:\n{text}")


def stored_code_cells(notebook: Path) -> list[Any]:
    """The code cells of ``notebook`` as stored in the repository (with their outputs)."""
    cells = nbformat.read(notebook, as_version=4).cells
    return [cell for cell in cells if cell.cell_type == "code"]


def stored_widget_cells(notebook: Path) -> list[int]:
    """Indices (among code cells) of the cells whose stored outputs include a widget."""
    code = stored_code_cells(notebook)
    return [
        index
        for index, cell in enumerate(code)
        if any(WIDGET_MIME in output.get("data", {}) for output in cell.outputs)
    ]


def cells_expected_to_raise(notebook: Path) -> list[int]:
    """Indices (among code cells) of the cells tagged ``raises-exception``."""
    code = stored_code_cells(notebook)
    return [
        index
        for index, cell in enumerate(code)
        if "raises-exception" in cell.metadata.get("tags", [])
    ]


_TRACEBACK_CELLS_JS = """
() => [...document.querySelectorAll('.jp-NotebookPanel-notebook .jp-CodeCell')]
  .map((cell, index) => [index, cell.querySelector('.jp-OutputArea')?.innerText || ''])
  .filter(([index, text]) => text.includes('Traceback (most recent call last)'))
  .map(([index, text]) => index)
"""


def cells_with_tracebacks(page: Page) -> list[int]:
    """Indices (among code cells) of the cells whose rendered output shows a traceback."""
    return page.evaluate(_TRACEBACK_CELLS_JS)


# A rendered widget: ipywidgets' renderer puts the view (class `jupyter-widgets`) directly
# inside the output element; until then the output says "Loading widget...".
RENDERED_WIDGET = ".jp-OutputArea-output:has(> .jupyter-widgets)"


def wait_for_widget(cell: Locator, within: float) -> Locator:
    """Wait until ``cell`` shows a rendered widget; fail on an error or a stuck placeholder.

    Returns the rendered view (the ``.jupyter-widgets`` element of the output).
    """
    rendered = cell.locator(f"{RENDERED_WIDGET} > .jupyter-widgets")
    deadline = time.monotonic() + within
    text = ""
    while time.monotonic() < deadline:
        text = output_text(cell)
        assert "Error displaying widget" not in text, f"widget failed to render: {text!r}"
        if rendered.count() and "Loading widget..." not in text:
            return rendered.first
        time.sleep(0.2)
    raise AssertionError(f"no rendered widget within {within} s; the cell's output: {text!r}")


def assert_not_upscaled(image: Locator) -> None:
    """An ``<img>`` is drawn at most at its own pixel size (not stretched, hence blurry)."""
    natural, drawn = image.evaluate("i => [i.naturalWidth, i.getBoundingClientRect().width]")
    assert natural > 0, "the image has no pixels"
    assert drawn <= natural + 1, f"image of {natural} px drawn {drawn:.0f} px wide"


_CONTENT_RIGHT_JS = """
el => {
  // The right edge of what is drawn inside `el`: its text, images and form controls (a
  // widget's boxes stretch to the full cell width even when their content is narrow).
  let right = el.getBoundingClientRect().left;
  const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (!node.textContent.trim()) continue;
    const range = document.createRange();
    range.selectNodeContents(node);
    for (const rect of range.getClientRects()) right = Math.max(right, rect.right);
  }
  const drawn = 'img, input, svg, canvas, button, .noUi-target, .progress';
  for (const item of el.querySelectorAll(drawn)) {
    const rect = item.getBoundingClientRect();
    if (rect.width > 0) right = Math.max(right, rect.right);
  }
  return right;
}
"""


_CENTRE_JS = """
el => new Promise(resolve => {
  el.scrollIntoView({block: 'center'});
  requestAnimationFrame(() => requestAnimationFrame(() => {
    const r = el.getBoundingClientRect();
    resolve([r.x, r.y, r.width, r.height]);
  }));
})
"""


def _settled_box(locator: Locator, within: float = 10) -> dict[str, float]:
    """Centre the element and return its box once two frames in a row agree.

    After a viewport resize JupyterLab lays the notebook out again over a few frames, so a
    box measured at once can be stale.
    """
    deadline = time.monotonic() + within
    previous = None
    while time.monotonic() < deadline:
        current = locator.evaluate(_CENTRE_JS)
        if current == previous:
            x, y, width, height = current
            return {"x": x, "y": y, "width": width, "height": height}
        previous = current
        time.sleep(0.1)
    raise AssertionError(f"the element kept moving for {within} s: {previous}")


def screenshot(locator: Locator, folder: Path, name: str, margin: int = 0) -> Path:
    """Save ``locator``'s element as ``folder/name`` (an artifact, never compared).

    JupyterLab scrolls the notebook inside the page, between the toolbar and the status bar,
    so an element taller than that area would come out clipped: the page is made taller for
    the shot (same width, so the same layout) and the element centred, then restored. The
    shot is cropped on the right to what the element draws, plus ``margin`` px all round
    (a cell's last line of text can touch its box; a widget has padding of its own).
    """
    page = locator.page
    size = page.viewport_size or {"width": 1280, "height": 900}
    box = locator.bounding_box()
    assert box is not None, f"{name}: the element is not displayed"
    taller = max(size["height"], int(box["height"]) + 400)
    path = folder / name
    try:
        if taller != size["height"]:
            page.set_viewport_size({"width": size["width"], "height": taller})
        box = _settled_box(locator)
        right = min(box["x"] + box["width"], locator.evaluate(_CONTENT_RIGHT_JS) + 12) + margin
        x, y = max(0, box["x"] - margin), max(0, box["y"] - margin)
        bottom = box["y"] + box["height"] + margin
        clip = {"x": x, "y": y, "width": right - x, "height": bottom - y}
        page.screenshot(path=str(path), clip=clip, animations="disabled")
    finally:
        page.set_viewport_size(size)
    assert path.stat().st_size > 1000, f"{path} is suspiciously small"
    return path
