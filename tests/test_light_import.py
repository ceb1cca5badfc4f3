"""``import nb_dist`` is light: each public name is imported where it is first used.

A rank, a Ray node agent, a script and ``nb-dist run`` import only their own side: no
widgets, no IPython (0.07 s of it), and ``import nb_dist`` alone not even torch. What the
import still does (``nb_dist/_at_import.py``) happens only where it is needed. Each check

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast
runs in a fresh interpreter: what this test process has imported tells nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import nb_dist

#: Modules that belong to the notebook's side: none of them in a rank, an agent or a script.
FRONTEND = ("IPython", "ipywidgets", "matplotlib", "traitlets", "nb_dist.views")


def _python(code: str, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; the JSON it printed last."""
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=150, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_import_nb_dist_imports_no_api_module_and_not_torch():
    found = _python(
        """
        import json, sys
        import nb_dist
        print(json.dumps(sorted(sys.modules)))
        """
    )
    roots = ("torch", "IPython", "ipywidgets", "matplotlib", "traitlets", "ray")
    heavy = [m for m in found if m.split(".")[0] in roots]
    assert heavy == []
    ours = sorted(m for m in found if m.startswith("nb_dist"))
    assert "nb_dist._kernel._launcher" not in ours and "nb_dist.views" not in ours, ours
    assert len(ours) <= 8, ours  # the package, its import-time module and what it needs


def test_every_public_name_resolves_on_first_use_and_is_listed():
    found = _python(
        """
        import json, sys
        import nb_dist
        before = "nb_dist._kernel._launcher" in sys.modules
        launcher = nb_dist.notebook_launcher
        names = {}
        exec("from nb_dist import *", names)
        print(json.dumps({
            "before": before, "after": "nb_dist._kernel._launcher" in sys.modules,
            "star": sorted(n for n in names if not n.startswith("__")),
            "all": sorted(nb_dist.__all__), "dir": sorted(set(nb_dist.__all__) - set(dir(nb_dist))),
            "module": nb_dist.WorkerFailedError.__module__,
            "magic": callable(nb_dist.load_ipython_extension),
        }))
        """
    )
    assert (found["before"], found["after"]) == (False, True)
    assert found["star"] == found["all"] and found["dir"] == []
    assert found["module"] == "nb_dist" and found["magic"]
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        nb_dist.not_a_name  # noqa: B018 - the lookup is the test


@pytest.mark.timeout(150)
def test_a_script_launch_and_its_fresh_ranks_import_no_frontend_module():
    found = _python(
        f"""
        import json, sys
        import nb_dist

        def imported():
            import sys
            return [m for m in {FRONTEND!r} if m in sys.modules]

        if __name__ == "__main__":
            ranks = {{m: list(nb_dist.notebook_launcher(imported, num_processes=2, start_method=m))
                     for m in ("spawn", "forkserver")}}
            kernel_side = [m for m in {FRONTEND!r} if m in sys.modules]
            print(json.dumps({{"ranks": ranks, "script": kernel_side}}))
        """
    )
    assert found == {"ranks": {"spawn": [[], []], "forkserver": [[], []]}, "script": []}


def test_cuda_touches_are_recorded_once_torch_arrives_in_either_order():
    code = """
        import json, sys
        FIRST
        from nb_dist._shared import _cuda_touches as touches
        waiting = touches.state()
        import torch
        hooks = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_WhenTorchArrives"]
        built = bool(torch.version.cuda or getattr(torch.version, "hip", None))
        print(json.dumps({"before": waiting, "after": touches.state(), "hooks": hooks,
                          "built": built}))
    """
    nb_dist_first = _python(code.replace("FIRST", "import nb_dist"))
    torch_first = _python(code.replace("FIRST", "import torch, nb_dist"))
    final = "recording" if nb_dist_first["built"] else "CPU build"
    assert nb_dist_first == {"before": "waiting for torch", "after": final, "hooks": [],
                             "built": nb_dist_first["built"]}  # fmt: skip
    assert (torch_first["before"], torch_first["after"], torch_first["hooks"]) == (final, final, [])


def test_the_cuda_touch_recorder_can_be_turned_off():
    """NB_DIST_CUDA_RECORDER=0: no import hook, nothing wrapped when torch arrives (the state
    stays "off", where a CPU build says "CPU build" and a CUDA build "recording")."""
    code = """
        import json, sys
        import nb_dist
        from nb_dist._shared import _cuda_touches as touches
        hooks = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_WhenTorchArrives"]
        import torch
        print(json.dumps({"state": touches.state(), "hooks": hooks}))
    """
    assert _python(code, env={"NB_DIST_CUDA_RECORDER": "0"}) == {"state": "off", "hooks": []}


@pytest.mark.timeout(150)
def test_no_rank_and_no_fork_server_records_cuda_touches():
    """Only a process that may launch records where CUDA was first touched: a rank stops the
    recorder it inherited (fork) or that ``import nb_dist`` started (spawn, forkserver), and
    the fork server stops it before its preload imports torch."""
    found = _python(
        """
        import json, sys
        import nb_dist
        from nb_dist._shared import _cuda_touches

        def recorder():
            import sys
            from nb_dist._shared import _cuda_touches
            hooks = [f for f in sys.meta_path if type(f).__name__ == "_WhenTorchArrives"]
            return (_cuda_touches.state(), len(hooks),
                    "nb_dist._rank._fork_server" in sys.modules)

        if __name__ == "__main__":
            waiting = _cuda_touches.state()
            ranks = {m: nb_dist.notebook_launcher(recorder, num_processes=2, start_method=m)
                     for m in ("fork", "spawn", "forkserver")}
            print(json.dumps({"ranks": {m: list(r) for m, r in ranks.items()},
                              "kernel": [waiting, _cuda_touches.state()]}))
        """
    )
    off, from_server = ["off", 0, False], ["off", 0, True]
    assert found["ranks"] == {"fork": [off, off], "spawn": [off, off],
                              "forkserver": [from_server, from_server]}  # fmt: skip
    # The launching process still records (or knows its torch is a CPU build).
    assert found["kernel"][0] == "waiting for torch"
    assert found["kernel"][1] in ("recording", "CPU build")


def test_a_rank_and_a_node_agent_import_nothing_of_the_kernel():
    """What a rank runs (its entry) and what a node agent runs load no module of ``_kernel``:
    ``import nb_dist`` reaches the kernel's side only in an IPython shell."""
    found = _python(
        """
        import json, sys
        import nb_dist._rank._entry, nb_dist._node._agent
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("nb_dist._kernel"))))
        """
    )
    assert found == [], found


def test_in_a_rank_import_nb_dist_does_nothing_of_the_kernels():
    found = _python(
        """
        import json, sys
        import nb_dist
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("nb_dist"))))
        """,
        env={"NB_DIST_IN_RANK": "1"},
    )
    assert "nb_dist._shared._cuda_touches" not in found, found
