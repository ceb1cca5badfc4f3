"""Code shipped by value keeps the cell it came from, with every supported cloudpickle.

cloudpickle 3.1.3 renames every code object it ships ``<dynamic-code>``; a spawned rank's
traceback, its hang report and ``%debug`` would then lose ``Cell In[N]`` and the source line
(``nb_dist/_shared/_shipping.py``). The kernel tests run once with the installed cloudpickle
and once more for each other cloudpickle in ``NB_DIST_TEST_CLOUDPICKLE`` (folders made with
``pip install --target``, separated by ``os.pathsep``): ``.ci/run`` puts the declared lower
bound there, so both sides of the rename are tested on every run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import cloudpickle
import pytest
from kernel_helpers import execute, execute_answering, line_in

from nb_dist._shared import _shipping

pytestmark = pytest.mark.timeout(240)

CELL_FILE = "/tmp/ipykernel_4242/1234567.py"  # the kind of name IPython gives a cell

SOURCE = """
def helper(x):
    inner = lambda y: 1 / y
    return inner(x)

class Model:
    def forward(self, x):
        return helper(x)

def outer():
    def nested():
        return Model().forward(0)
    return nested
"""


def _code_objects(code: types.CodeType) -> list[types.CodeType]:
    found = [code]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found += _code_objects(const)
    return found


def test_dumps_keeps_every_file_name_in_a_fresh_interpreter(tmp_path):
    """Functions, nested functions, lambdas and methods rebuilt in another process still
    name the cell's file (where plain cloudpickle may say ``<dynamic-code>``)."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(compile(SOURCE, CELL_FILE, "exec"), namespace)
    payload = tmp_path / "payload.pickle"
    payload.write_bytes(_shipping.dumps((namespace["outer"](), namespace["Model"])))
    check = textwrap.dedent(
        f"""
        import sys, traceback, types
        from nb_dist._shared import _shipping
        nested, model = _shipping.loads(open({str(payload)!r}, "rb").read())
        def codes(code):
            yield code
            for const in code.co_consts:
                if isinstance(const, types.CodeType):
                    yield from codes(const)
        names = {{c.co_filename for f in (nested, model.forward) for c in codes(f.__code__)}}
        try:
            nested()
        except ZeroDivisionError:
            frames = traceback.extract_tb(sys.exc_info()[2])[1:]
        print(sorted(names), [(f.filename, f.name) for f in frames])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    names = [CELL_FILE]
    frames = [(CELL_FILE, n) for n in ("nested", "forward", "helper", "<lambda>")]
    assert done.stdout.strip() == f"{names} {frames}"


def test_dumps_is_what_cloudpickle_would_ship_but_the_file_names():
    """Everything but ``co_filename`` is cloudpickle's own: the rebuilt code is equal to the
    original, and a payload is deterministic (the same bytes for the same function)."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(compile(SOURCE, CELL_FILE, "exec"), namespace)
    outer = namespace["outer"]
    assert isinstance(outer, types.FunctionType)
    rebuilt = _shipping.loads(_shipping.dumps(outer))
    assert rebuilt.__code__ == outer.__code__
    before = [(c.co_filename, c.co_qualname) for c in _code_objects(outer.__code__)]
    assert [(c.co_filename, c.co_qualname) for c in _code_objects(rebuilt.__code__)] == before
    assert _shipping.dumps(outer) == _shipping.dumps(outer)
    # Values without code are pickled exactly as cloudpickle does.
    assert _shipping.dumps({"lr": 0.1, "steps": [1, 2]}) == cloudpickle.dumps(
        {"lr": 0.1, "steps": [1, 2]}
    )


# ------------------------------------------------------------------ in a kernel, per version
def _other_cloudpickles() -> list[Path]:
    return [Path(p) for p in os.environ.get("NB_DIST_TEST_CLOUDPICKLE", "").split(os.pathsep) if p]


def _version_in(folder: Path) -> str:
    text = (folder / "cloudpickle" / "__init__.py").read_text()
    found = re.search(r"""__version__ = ["']([^"']+)["']""", text)
    assert found, f"no cloudpickle in {folder}"
    return found.group(1)


VERSIONS = [pytest.param(None, id=f"installed-{cloudpickle.__version__}")] + [
    pytest.param(folder, id=f"target-{_version_in(folder)}") for folder in _other_cloudpickles()
]
if not _other_cloudpickles():
    VERSIONS.append(
        pytest.param(
            None,
            id="lower-bound",
            marks=pytest.mark.skip(
                reason="no other cloudpickle given: set NB_DIST_TEST_CLOUDPICKLE to a folder "
                "made with `pip install --target DIR cloudpickle==VERSION` (.ci/run does)"
            ),
        )
    )

CELL = """
import os, time
import torch.distributed as dist
import nb_dist
from nb_dist import notebook_launcher

def helper(x):
    inner = lambda y: 1 / y
    return inner(x)

def fails_on_rank_1():
    def nested():
        return helper(0) if int(os.environ["RANK"]) == 1 else 0
    return nested()

def sleeps_on_rank_1(folder):
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        open(os.path.join(folder, "asleep"), "w").close()
        time.sleep(60)
    return dist.get_rank()
"""

# A spawned rank imports torch before it reaches the function: seconds on a loaded 2-core box.
# The hang test's timeout leaves room for that, and the rank's file proves it was asleep when
# the timeout fired (the report's stack is only there once it is).
SPAWN_TIMEOUT = 20


@pytest.fixture(params=VERSIONS)
def versioned_kernel(request, kernels):
    folder: Path | None = request.param
    env = {"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
    _, kc = kernels(env=env if folder is not None else None)
    expected = cloudpickle.__version__ if folder is None else _version_in(folder)
    seen = execute(kc, "import cloudpickle\ncloudpickle.__version__").expect_ok()
    assert seen.result_text == repr(expected)
    return kc


def _assert_names_the_cell(text: str, cell: str) -> None:
    assert "<dynamic-code>" not in text, text
    lam = f"{cell}, line {line_in(CELL, 'inner = lambda')}, in <lambda>"
    nested = f"{cell}, line {line_in(CELL, 'return helper(0)')}, in nested"
    assert lam in text and nested in text, text
    assert "inner = lambda y: 1 / y" in text, text  # the source line, from the cell


@pytest.mark.kernel
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_shipped_rank_names_the_cell_in_its_traceback(versioned_kernel, method):
    kc = versioned_kernel
    define = execute(kc, CELL).expect_ok()
    run = execute(
        kc, f"notebook_launcher(fails_on_rank_1, num_processes=2, start_method={method!r})"
    )
    assert run.error is not None and run.error["ename"] == "WorkerFailedError", run.stdout()
    text = run.error_text()
    assert text.startswith("rank 1 failed first: ZeroDivisionError"), text
    _assert_names_the_cell(text, f"Cell In[{define.execution_count}]")


@pytest.mark.kernel
def test_a_spawned_rank_names_the_cell_in_a_hang_report_and_in_debug(versioned_kernel, tmp_path):
    kc = versioned_kernel
    define = execute(kc, CELL).expect_ok()
    cell = f"Cell In[{define.execution_count}]"
    hung = execute(
        kc,
        f"notebook_launcher(sleeps_on_rank_1, args=({str(tmp_path)!r},), num_processes=2, "
        f"start_method='spawn', timeout={SPAWN_TIMEOUT})",
        timeout=SPAWN_TIMEOUT + 60,
    )
    assert hung.error is not None and hung.error["ename"] == "LaunchTimeoutError"
    text = hung.error_text()
    assert (tmp_path / "asleep").exists(), (
        f"rank 1 had not reached its sleep within timeout={SPAWN_TIMEOUT} s: {text}"
    )
    assert "<dynamic-code>" not in text, text
    where = f"{cell}, line {line_in(CELL, 'time.sleep(60)')}, in sleeps_on_rank_1"
    assert where in text, text

    failed = execute(
        kc,
        "notebook_launcher(fails_on_rank_1, num_processes=2, start_method='spawn', "
        "debug='postmortem')",
    )
    assert failed.error is not None and failed.error["ename"] == "WorkerFailedError"
    talk = execute_answering(kc, "%debug", ["w", "q"])
    talk.run.expect_ok()
    out = talk.run.stdout()
    assert "<dynamic-code>" not in out, out
    assert "<lambda>()" in out and "nested()" in out, out
    assert "inner = lambda y: 1 / y" in out, out  # pdb found the cell's source


@pytest.mark.kernel
def test_live_ranks_name_the_cell_of_a_function_they_run(versioned_kernel):
    """``Ranks.run`` ships its function by value even to forked ranks."""
    kc = versioned_kernel
    define = execute(kc, CELL).expect_ok()
    run = execute(kc, "with nb_dist.Ranks(2) as ranks:\n    ranks.run(fails_on_rank_1)")
    assert run.error is not None and run.error["ename"] == "WorkerFailedError", run.stdout()
    _assert_names_the_cell(run.error_text(), f"Cell In[{define.execution_count}]")
