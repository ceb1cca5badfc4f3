"""A strict drop-in for code written for ``accelerate.notebook_launcher``.

The strongest check runs Accelerate's own notebook-launcher test module (it ships inside the
package) with only its ``notebook_launcher`` import swapped to nb_dist, on 2 CPU processes.
The others pin each convention that module and Accelerate users rely on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_helpers import execute

from nb_dist import UnsafeLaunchError, WorkerFailedError, notebook_launcher

accelerate = pytest.importorskip("accelerate", reason="the test extra installs accelerate")
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402

ACCELERATE_IMPORT = "from accelerate import PartialState, notebook_launcher"


@pytest.mark.timeout(300)
def test_accelerates_own_notebook_tests_pass_with_nb_dist(tmp_path):
    """accelerate.test_utils.scripts.test_notebook, launcher swapped, 2 processes: all pass."""
    import accelerate.test_utils.scripts.test_notebook as original

    source = Path(original.__file__).read_text()
    assert ACCELERATE_IMPORT in source, "Accelerate's test module changed its import line"
    swapped = source.replace(
        ACCELERATE_IMPORT,
        "from accelerate import PartialState\nfrom nb_dist import notebook_launcher",
    )
    module = tmp_path / "test_notebook_with_nb_dist.py"
    module.write_text(swapped)
    env = {**os.environ, "ACCELERATE_NUM_PROCESSES": "2", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--override-ini=addopts=", "-rs", str(module)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    summary = run.stdout.strip().splitlines()[-1]
    # Every test of the module ran and passed; only the bitsandbytes one may skip (bnb is not
    # installed). Accelerate 1.13 (Kaggle's) has 6 tests, 1.14 and later 7.
    defined = len(re.findall(r"^def test_", source, re.MULTILINE))
    passed = int(re.search(r"(\d+) passed", summary)[1])
    skipped = re.search(r"(\d+) skipped", summary)
    assert "failed" not in summary and "error" not in summary, run.stdout
    if skipped:
        assert skipped[1] == "1" and "bitsandbytes" in run.stdout, run.stdout
    assert passed + (1 if skipped else 0) == defined, run.stdout


def _boom():
    if int(os.environ["RANK"]) == 1:
        raise RuntimeError("rank 1 is broken")
    import threading

    threading.Event().wait()


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_failure_is_a_child_failed_error_with_its_data():
    with pytest.raises(ChildFailedError) as info:
        notebook_launcher(_boom, num_processes=2)
    error = info.value
    assert isinstance(error, WorkerFailedError)  # and everything nb_dist offers
    assert str(error).startswith("rank 1 failed first: RuntimeError: rank 1 is broken")
    rank, failure = error.get_first_failure()
    assert rank == 1 and failure.message == "RuntimeError: rank 1 is broken"
    assert failure.local_rank == 1 and failure.pid == error.root_cause.pid
    assert failure.exitcode == 1
    assert set(error.failures) == {1}  # rank 0 was stopped by the launcher, not failed
    assert error.name == "notebook_launcher"


@pytest.mark.fast
def test_unsafe_launch_is_also_a_value_error():
    """Accelerate raises ValueError for kernel states it refuses; so does nb_dist."""
    assert issubclass(UnsafeLaunchError, ValueError)
    assert issubclass(UnsafeLaunchError, RuntimeError)  # as before


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """accelerate.notebook_launcher runs torch's elastic agent in this process, whose
    PContext installs SIGINT/SIGTERM handlers that raise and are never put back: Ctrl-C
    would then fail whatever test runs next instead of stopping pytest."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _environment(tag, folder):
    Path(folder, f"{tag}{os.environ['RANK']}.json").write_text(json.dumps(dict(os.environ)))
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    return error_file


@pytest.mark.fast
@pytest.mark.timeout(120)
def test_worker_environment_is_a_superset_of_accelerates(tmp_path):
    accelerate.notebook_launcher(_environment, ("acc", tmp_path), num_processes=2)
    files = notebook_launcher(_environment, ("nb", tmp_path), num_processes=2)
    for rank in (0, 1):
        theirs = json.loads((tmp_path / f"acc{rank}.json").read_text())
        ours = json.loads((tmp_path / f"nb{rank}.json").read_text())
        missing = sorted(set(theirs) - set(ours))
        assert missing == [], f"variables Accelerate's workers get and nb_dist's lack: {missing}"
        same = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "ROLE_NAME", "NPROC", "MIXED_PRECISION")
        for name in same:
            assert ours[name] == theirs[name], (name, ours[name], theirs[name])
    # One error file per rank, as torchrun gives, and none left after the launch.
    assert len(set(files)) == 2 and all(f.endswith("error.json") for f in files)
    assert not any(Path(f).parent.parent.exists() for f in files)


def _recorded_failure():
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        raise ValueError("recorded")

    main()


@pytest.mark.timeout(60)
def test_record_decorator_works_in_a_worker():
    """torch's @record writes to TORCHELASTIC_ERROR_FILE and re-raises: the usual failure."""
    with pytest.raises(WorkerFailedError) as info:
        notebook_launcher(_recorded_failure, num_processes=1)
    assert str(info.value).startswith("rank 0 failed first: ValueError: recorded")


@pytest.mark.kernel
@pytest.mark.timeout(120)
def test_a_cell_ending_with_an_accelerate_style_launch_shows_nothing(kernels):
    """Every rank returned None (as Accelerate's launcher does): no Out[n]; values still show."""
    _, kc = kernels()
    execute(
        kc,
        "from nb_dist import notebook_launcher\n"
        "def train():\n    print('trained')\n"
        "def value():\n    return 7",
        timeout=60,
    ).expect_ok()
    silent = execute(kc, "notebook_launcher(train, num_processes=2)").expect_ok()
    assert silent.result_text is None
    assert silent.stdout().count("trained") == 2
    kept = execute(kc, "r = notebook_launcher(train, num_processes=2); r, len(r)").expect_ok()
    assert kept.result_text == "(LaunchResult([None, None]), 2)"
    shown = execute(kc, "notebook_launcher(value, num_processes=2)").expect_ok()
    assert shown.result_text == "LaunchResult([7, 7])"
