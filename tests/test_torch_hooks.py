"""Canaries for the torch private functions nb_dist hooks in a rank (``HOOKED`` in
``_rendezvous`` and ``_groups``).

Each is looked up by name, so a torch release that renames one switches its feature off
without an error: these tests fail loudly on such a release instead. The degrade tests show
what a torch without them gets: no hook, no half-installed hook, and no error.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch
import torch.distributed as dist

from nb_dist import notebook_launcher
from nb_dist._rank import _groups, _rendezvous
from nb_dist._shared import _torch_compat

pytestmark = pytest.mark.timeout(120)


def _hooks_in_this_rank() -> dict[str, bool]:
    found = {}
    for module_name, names in _rendezvous.HOOKED.items():
        module = importlib.import_module(module_name)
        for name in names:
            function = getattr(module, name, None)
            found[f"{module_name}.{name}"] = hasattr(function, "__wrapped__")
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    for name in _groups.HOOKED:
        found[f"kept: {name}"] = getattr(getattr(c10d, name, None), "_nb_dist_keeps", False)
    dist.init_process_group("gloo")
    found["the default group is kept"] = _groups.kept() > 0
    # A second install (as a re-run would do) finds them in place and wraps nothing twice.
    missing = _rendezvous.install(lambda message: None, "127.0.0.1", 1)
    wrapped_twice = hasattr(c10d.rendezvous.__wrapped__, "_nb_dist_hook")
    kept_twice = hasattr(c10d._update_default_pg.__wrapped__, "_nb_dist_keeps")
    found["installed once"] = not missing and not _groups.install()
    found["installed once"] &= not wrapped_twice and not kept_twice
    return found


def test_every_hook_is_installed_in_a_rank_on_this_torch():
    found = notebook_launcher(_hooks_in_this_rank, num_processes=1)[0]
    off = [name for name, hooked in found.items() if not hooked]
    assert not off, (
        f"torch {torch.__version__} lacks what nb_dist hooks ({off}): find the renamed "
        "function in torch/distributed and teach nb_dist/_rank/_rendezvous.py or _groups.py "
        "both names."
    )


def test_a_torch_without_the_store_factory_gets_no_hook_and_no_error():
    module = types.SimpleNamespace()
    assert _rendezvous._wrap_store_factory(module, "127.0.0.1", 29500) is False
    assert vars(module) == {}


@pytest.mark.parametrize("present", ["rendezvous", "_update_default_pg"])
def test_a_torch_with_half_of_the_rendezvous_functions_gets_neither_hook(present):
    def original(*args, **kwargs):
        return args

    c10d = types.SimpleNamespace(**{present: original})
    assert _rendezvous._wrap_rendezvous(c10d, lambda message: None) is False
    assert getattr(c10d, present) is original  # nothing half-installed


def test_a_torch_without_the_group_factories_keeps_nothing_and_says_so():
    def update(pg):
        return None

    c10d = types.SimpleNamespace(_update_default_pg=update)
    missing = _groups.install(c10d)
    assert missing == ["torch.distributed.distributed_c10d._new_process_group_helper"]
    before = _groups.kept()
    group = object()
    c10d._update_default_pg(group)  # the one it has is still wrapped
    assert _groups.kept() == before + 1


# ----------------------------------------------------------------------------- every private
def _lookup(private: _torch_compat.Private):
    """The private as this torch has it (``None``: missing)."""
    if private.name in _torch_compat.INSTANCE_ATTRIBUTES:
        # An attribute torch's class sets from its __init__'s parameter of the same name (it
        # refuses an empty table, so the signature stands in for an instance).
        import inspect

        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        return inspect.signature(ChildFailedError.__init__).parameters.get(private.name)
    module = importlib.import_module(private.module)
    return getattr(module, private.name, None)


@pytest.mark.parametrize(
    "private", _torch_compat.PRIVATES, ids=[p.qualified for p in _torch_compat.PRIVATES]
)
def test_every_torch_private_nb_dist_uses_exists_on_this_torch(private):
    """One canary per entry of ``_torch_compat.PRIVATES``: a torch release that renames one
    fails here, naming what users would lose, instead of quietly switching a feature off."""
    if _torch_compat.cuda_only(private) and not torch.backends.cuda.is_built():
        pytest.skip(f"{private.qualified} exists on CUDA builds only (this torch is CPU-only)")
    assert _lookup(private) is not None, (
        f"torch {torch.__version__} has no {private.qualified} (used by nb_dist/"
        f"{private.used_by}); without it {private.without}. Find its new name and teach "
        "nb_dist/_shared/_torch_compat.py."
    )


def test_the_registry_names_every_private_the_package_reaches_for():
    """A private reached in nb_dist's code is listed in the registry (so it has a canary)."""
    import re
    from pathlib import Path

    listed = {p.name for p in _torch_compat.PRIVATES}
    package = Path(_torch_compat.__file__).resolve().parent.parent
    unlisted = set()
    for path in package.rglob("*.py"):
        for name in re.findall(r"[\"'.](_[a-z][a-zA-Z_]*c10d[a-zA-Z_]*|_pg_map|_set_pg_timeout"
                               r"|_cuda_[a-zA-Z]+|_device_count_nvml|_update_default_pg"
                               r"|_new_process_group_helper)\b", path.read_text()):  # fmt: skip
            if name not in listed:
                unlisted.add(f"{path.name}: {name}")
    assert not unlisted, sorted(unlisted)


def test_a_missing_private_degrades_and_is_logged(caplog):
    module = types.SimpleNamespace(__name__="torch.fake")
    with caplog.at_level("INFO", logger="nb_dist"):
        assert _torch_compat.replace(module, "_pg_map", lambda original: original) is False
        assert not _torch_compat.present(module, "rendezvous", "_update_default_pg")
    assert vars(module) == {"__name__": "torch.fake"}  # nothing half-installed
    text = caplog.text
    assert "torch lacks torch.fake._pg_map" in text and "breakpoint" in text
    assert "torch.fake.rendezvous" in text and "torch.fake._update_default_pg" in text


def test_group_timeouts_say_what_they_could_not_do():
    """Outside a process group there is nothing to lengthen; torch's map is simply empty."""
    assert _torch_compat.set_group_timeouts(__import__("datetime").timedelta(hours=1)) == []


def _lengthen_with_a_bad_value() -> list[str]:
    dist.init_process_group("gloo")
    good = _torch_compat.set_group_timeouts(__import__("datetime").timedelta(hours=1))
    bad = _torch_compat.set_group_timeouts("one hour")  # type: ignore[arg-type]
    return [len(good), len(bad), bad[0] if bad else ""]


def test_a_group_timeout_that_cannot_be_set_is_reported_not_swallowed():
    """In a rank with a real group: a timedelta is taken; a value torch refuses is reported
    (and logged) for that group, where a suppressed exception used to hide it."""
    good, bad, text = notebook_launcher(_lengthen_with_a_bad_value, num_processes=1)[0]
    assert good == 0
    assert bad >= 1 and "Error" in text, text
