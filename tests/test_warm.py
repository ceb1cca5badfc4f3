"""Warm relaunches: later launches inherit the modules earlier launches' workers imported.

Each scenario runs in a fresh interpreter: whether ``torch._dynamo`` is already imported is
exactly what is under test, and this test process may have imported it long ago.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from nb_dist._shared._imports import MAX_NAMES, worth_importing

SCRIPT = """
import json, os, sys
import torch, torch.nn as nn, torch.distributed as dist
from nb_dist import notebook_launcher
from nb_dist._kernel import _warm
environ = dict(os.environ)  # the launcher and its warm imports change none of it

def ddp():
    had = "torch._dynamo" in sys.modules      # inherited from the kernel?
    dist.init_process_group("gloo")
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    del model
    return had

seen = []
for _ in range(2):
    seen.append(notebook_launcher(ddp, num_processes=2, **KWARGS)[0])
    _warm.wait()
changed = sorted(k for k in {*os.environ, *environ} if os.environ.get(k) != environ.get(k))
print(json.dumps({"seen": seen, "kernel": "torch._dynamo" in sys.modules,
                  "imported": _warm.imported(), "environ_changed": changed}))
"""


def _run(kwargs: str, env: dict[str, str] | None = None) -> dict:
    code = SCRIPT.replace("**KWARGS", kwargs or "")
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=150, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.fast
@pytest.mark.timeout(180)
def test_second_launch_inherits_what_the_first_imported():
    result = _run("")
    assert result["seen"] == [False, True]  # the 2nd launch's workers found torch._dynamo
    assert result["kernel"] and "torch._dynamo" in result["imported"]
    # Importing torch._inductor sets TORCHINDUCTOR_CACHE_DIR; the warm import undoes it.
    assert result["environ_changed"] == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("kwargs", "env"), [("warm_imports=False", None), ("", {"NB_DIST_WARM_IMPORTS": "0"})]
)
def test_opt_out(kwargs, env):
    result = _run(kwargs, env)
    expected = {"seen": [False, False], "kernel": False, "imported": [], "environ_changed": []}
    assert result == expected


@pytest.mark.fast
def test_bad_option_is_refused():
    from nb_dist import notebook_launcher

    with pytest.raises(TypeError, match=r"warm_imports='yes' must be True or False"):
        notebook_launcher(print, num_processes=1, warm_imports="yes")


@pytest.mark.fast
def test_worth_importing_keeps_safe_subtree_roots():
    new = {
        "torch._dynamo", "torch._dynamo.eval_frame", "torch._dynamo.utils", "sympy",
        "sympy.core", "mpmath", "decimal", "colorama", "my_project.data", "torch.fx.experimental",
        "torch._inductor", "torch._inductor.codecache",  # may start compile pools: never
    }  # fmt: skip
    assert worth_importing(new) == ["mpmath", "sympy", "torch._dynamo", "torch.fx.experimental"]
    assert (
        worth_importing(f"torch.m{i}" for i in range(200))
        == sorted(f"torch.m{i}" for i in range(200))[:MAX_NAMES]
    )


# ----------------------------------------------------------------------------- at import
FIRST_DDP_CELL = """
%%ranks
had = "torch._dynamo" in sys.modules  # inherited from the kernel at the fork?
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
had
"""


@pytest.mark.timeout(180)
def test_a_kernel_prefetches_at_import_and_the_first_session_inherits_it(kernels):
    """In a kernel, `import nb_dist` starts importing torch._dynamo in the background; the
    first live session (and launch) forks after it and never imports it per rank."""
    from kernel_helpers import execute

    _, kc = kernels()
    execute(kc, "import sys, torch, nb_dist\nfrom nb_dist._kernel import _warm").expect_ok()
    run = execute(kc, "_warm.wait(); print(_warm.imported(), 'torch._dynamo' in sys.modules)")
    assert run.expect_ok().stdout().strip() == "['torch._dynamo'] True"
    execute(kc, "%load_ext nb_dist\nranks = nb_dist.Ranks(2)").expect_ok()
    cell = execute(kc, FIRST_DDP_CELL.strip(), timeout=120).expect_ok()
    assert cell.result_text == "[all ranks] True"
    execute(kc, "ranks.close()").expect_ok()


@pytest.mark.timeout(120)
def test_no_prefetch_when_switched_off_or_outside_a_kernel(kernels):
    from kernel_helpers import execute

    _, kc = kernels(env={"NB_DIST_WARM_IMPORTS": "0"})
    run = execute(kc, "import sys, nb_dist\nfrom nb_dist._kernel import _warm\n_warm.wait()\n"
                      "print(_warm.imported(), 'torch._dynamo' in sys.modules)")  # fmt: skip
    assert run.expect_ok().stdout().strip() == "[] False"
    # A plain process: the warm-import machinery is not even imported.
    script = (
        "import sys, nb_dist\n"
        "print('torch._dynamo' in sys.modules, 'nb_dist._kernel._warm' in sys.modules)"
    )
    plain = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=60, check=True)  # fmt: skip
    assert plain.stdout.strip() == "False False"
