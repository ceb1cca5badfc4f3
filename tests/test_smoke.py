import os

import pytest
import torch
import torch.distributed as dist

from nb_dist import notebook_launcher

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast


def _allreduce(scale):
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"sum is {t.item():g}")
    return t.item() * scale, os.getpid()


def test_results_come_back_by_rank(capsys):
    result = notebook_launcher(_allreduce, args=(2,), num_processes=2)
    assert [v for v, _ in result] == [6.0, 6.0]
    out = capsys.readouterr().out
    assert "[rank 0] sum is 3" in out and "[rank 1] sum is 3" in out
    assert [o.status for o in result.outcomes] == ["ok", "ok"]
