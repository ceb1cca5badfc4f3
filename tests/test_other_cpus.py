"""The teaching notebooks give their stored outputs on any CPU, not only the one that stored them.

CI lands on whatever machine is at hand. float32 sums taken in another order (AVX-512 or AVX2
or scalar kernels, another GEMM code path, more intra-op threads) differ in their last digits,
so a comparison in the kit that is exact where it should have a tolerance prints ``False`` on
the next machine (notebook 15 did, on an AVX-512 Xeon). Here every notebook of the solutions
edition runs again under nbval with other kernels than this machine picks by itself:

- ``ATEN_CPU_CAPABILITY=default``: torch's scalar kernels instead of AVX2/AVX-512;
- ``MKL_ENABLE_INSTRUCTIONS=SSE4_2``: another matrix-multiply code path in MKL;
- ``OMP_NUM_THREADS=2``: two intra-op threads in the kernel and in every rank (the launcher
  gives each rank what the user set), where CI's 2 cores give each of 2 ranks one.

A control first proves that these settings do change float32 results on this machine (else the
notebook run would test nothing).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.ipynb"))
OTHER_CPU = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    "OMP_NUM_THREADS": "2",
}

SUMS = """
import torch
g = torch.Generator().manual_seed(0)
x = torch.randn(1_000_003, generator=g)
a, b = torch.randn(64, 256, generator=g), torch.randn(256, 64, generator=g)
print(repr(x.sum().item()), repr((a @ b).sum().item()))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OTHER_CPU}
    env.update(extra)
    return env


def _sums(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SUMS], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.timeout(240)
def test_the_other_settings_change_float32_sums_on_this_machine():
    """Control: the same sums in another order give other last digits (the test below has teeth)."""
    assert _sums(_env()) != _sums(_env(**OTHER_CPU))


# The one output that changes on purpose: the threads a rank gets (the appendix prints them;
# the launcher gives each rank what OMP_NUM_THREADS says, else cores / ranks).
THREADS_RULE = """
[the threads a rank gets: this test sets OMP_NUM_THREADS]
regex: threads: \\d+
replace: threads: N
"""


@pytest.mark.timeout(1200)
def test_every_notebook_gives_its_stored_outputs_with_other_cpu_kernels(tmp_path):
    rules = tmp_path / "sanitize.cfg"
    rules.write_text((ROOT / "tests" / "nbval_sanitize.cfg").read_text() + THREADS_RULE)
    options = [
        "--override-ini=addopts=",
        "-p",
        "no:cacheprovider",
        "--nbval",
        "--nbval-current-env",
        f"--nbval-sanitize-with={rules}",
        "--nbval-cell-timeout=170",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *options, "-q", *NOTEBOOKS],
        cwd=ROOT,
        env=_env(**OTHER_CPU),
        capture_output=True,
        text=True,
        timeout=1150,
    )
    report = re.sub(r"\x1b\[[0-9;]*m", "", run.stdout)
    assert run.returncode == 0, report[-20000:]
    assert re.search(r"\d+ passed", report), report[-2000:]
