"""Canaries for every torch private nb_dist uses (``_shared/_torch_compat.PRIVATES``), and
for the hooks it installs in a rank (``HOOKED`` in ``_rendezvous`` and ``_groups``).

Each private is looked up by name, so a torch release that renames one switches its feature
off without an error: the canaries fail loudly on such a release instead, naming the private,
the torch version and what users would lose. The degrade tests show what a torch without one
gets, using stand-in modules (torch itself is never patched here): no hook, no half-installed
hook, no error, and a log line that names what is missing.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nb_dist import notebook_launcher
from nb_dist._rank import _groups, _rendezvous
from nb_dist._shared import _torch_compat

pytestmark = [pytest.mark.fast, pytest.mark.timeout(120)]


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
C10D = "torch.distributed.distributed_c10d"
HOUR = timedelta(hours=1)


def _lookup(private: _torch_compat.Private):
    """The private as this torch has it (or its public replacement; ``None``: missing)."""
    if private.use == "set on an instance":
        # An attribute torch's class sets from its __init__'s parameter of the same name (it
        # refuses an empty table, so the signature stands in for an instance).
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        return inspect.signature(ChildFailedError.__init__).parameters.get(private.name)
    module = importlib.import_module(private.module)
    found = getattr(module, private.name, None)
    if found is None and private.public:
        found = getattr(module, private.public, None)
    return found


@pytest.mark.parametrize(
    "private", _torch_compat.PRIVATES, ids=[p.qualified for p in _torch_compat.PRIVATES]
)
def test_every_torch_private_nb_dist_uses_exists_on_this_torch(private):
    """One canary per entry of ``_torch_compat.PRIVATES``: a torch release that renames one
    fails here, naming what users would lose, instead of quietly switching a feature off."""
    if _torch_compat.cuda_only(private) and not torch.backends.cuda.is_built():
        pytest.skip(f"{private.qualified} exists on CUDA builds only (this torch is CPU-only)")
    found = _lookup(private)
    alternative = f" (nor its public replacement {private.public})" if private.public else ""
    assert found is not None, (
        f"torch {torch.__version__} has no {private.qualified}{alternative}, which nb_dist/"
        f"{private.used_by} uses (it exists since torch {private.since}); without it "
        f"{private.without}. Find its new name in torch's sources and teach "
        "nb_dist/_shared/_torch_compat.py."
    )
    if private.use in ("wrapped", "called"):
        assert callable(found), (
            f"torch {torch.__version__}'s {private.qualified} is a {type(found).__name__}, not "
            f"a function, so nb_dist cannot {'wrap' if private.use == 'wrapped' else 'call'} "
            f"it; without it {private.without}. Teach nb_dist/_shared/_torch_compat.py."
        )
    if private.use == "counter reset":
        assert isinstance(getattr(found, "group_count", None), int), (
            f"torch {torch.__version__}'s {private.qualified} has no integer group_count, "
            f"which nb_dist resets in a forked rank; without it {private.without}. Teach "
            "nb_dist/_shared/_torch_compat.py."
        )
    if private.use == "read":
        assert isinstance(found, dict), (
            f"torch {torch.__version__}'s {private.qualified} is a {type(found).__name__}, "
            f"not the dict nb_dist reads; without it {private.without}. Teach "
            "nb_dist/_shared/_torch_compat.py."
        )


def test_every_hook_a_rank_installs_is_in_the_registry():
    """``HOOKED`` of ``_rendezvous`` and ``_groups`` name only listed privates (with canaries)."""
    listed = {p.qualified for p in _torch_compat.PRIVATES}
    hooked = {f"{module}.{name}" for module, names in _rendezvous.HOOKED.items() for name in names}
    hooked |= {f"{C10D}.{name}" for name in _groups.HOOKED}
    assert hooked <= listed, sorted(hooked - listed)


def test_the_registry_names_every_private_the_package_reaches_for():
    """A private reached in nb_dist's code is listed in the registry (so it has a canary)."""
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


def test_only_the_compat_module_touches_torch_c():
    """``torch._C`` is reached through ``_torch_compat`` only (its functions say what a torch
    without a private loses); elsewhere in the package it is not named in code."""
    package = Path(_torch_compat.__file__).resolve().parent.parent
    found = [
        f"{path.relative_to(package)}:{number}"
        for path in package.rglob("*.py")
        if path.name != "_torch_compat.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "._C" in line.split("#")[0]
    ]
    assert not found, found


# Degrading: each private missing from a stand-in module, given to the function that uses it.
def _fake(name: str, **attributes: object) -> types.SimpleNamespace:
    """A stand-in for torch's module ``name`` with only ``attributes``."""
    return types.SimpleNamespace(__name__=name, **attributes)


def _fake_torch(**in_c: object) -> types.SimpleNamespace:
    """A stand-in for ``torch``: ``torch._C`` with only ``in_c``, an empty ``torch.cuda``."""
    return types.SimpleNamespace(_C=_fake("torch._C", **in_c), cuda=_fake("torch.cuda"))


def _function(*args, **kwargs):
    return args


def _wrapping(original):
    return functools.wraps(original)(lambda *args: original(*args))


#: For each private: what the function that uses it returns on a torch without it, and what it
#: returns there (the same as on a torch with nothing to do).
DEGRADED = {
    "torch.distributed.rendezvous._create_c10d_store": lambda: (
        _rendezvous._wrap_store_factory(_fake("torch.distributed.rendezvous"), "127.0.0.1", 1),
        False,
    ),
    f"{C10D}.rendezvous": lambda: (
        _rendezvous._wrap_rendezvous(_fake(C10D, _update_default_pg=_function), print),
        False,
    ),
    f"{C10D}._update_default_pg": lambda: (
        _rendezvous._wrap_rendezvous(_fake(C10D, rendezvous=_function), print),
        False,
    ),
    f"{C10D}._new_process_group_helper": lambda: (
        _groups.install(_fake(C10D, _update_default_pg=_function)),
        [f"{C10D}._new_process_group_helper"],
    ),
    f"{C10D}._pg_map": lambda: (
        _torch_compat.set_group_timeouts(HOUR, _fake(C10D, _set_pg_timeout=_function)),
        [f"torch {torch.__version__} has no {C10D}._pg_map"],
    ),
    f"{C10D}._set_pg_timeout": lambda: (
        _torch_compat.set_group_timeouts(HOUR, _fake(C10D, _pg_map={"group": None})),
        [f"torch {torch.__version__} has no {C10D}._set_pg_timeout"],
    ),
    f"{C10D}._world": lambda: (
        _groups.fresh_group_names(_fake(C10D, is_initialized=lambda: False)),
        False,
    ),
    "torch.distributed._functional_collectives.traceable_collective_remaps": lambda: (
        _torch_compat.collective_remaps(_fake("torch.distributed._functional_collectives")),
        {},
    ),
    "torch._C._cuda_getDeviceCount": lambda: (
        _torch_compat.wrap_cuda_entry_points(_fake_torch(_cuda_init=_function), _wrapping),
        ["_cuda_init"],
    ),
    "torch._C._cuda_init": lambda: (
        _torch_compat.wrap_cuda_entry_points(
            _fake_torch(_cuda_getDeviceCount=_function), _wrapping
        ),
        ["_cuda_getDeviceCount"],
    ),
    "torch._C._cuda_isInBadFork": lambda: (_torch_compat.bad_fork_check(_fake_torch())(), False),
    "torch.cuda._device_count_nvml": lambda: (_torch_compat.gpus_from_nvml(_fake_torch()), 0),
}


def test_every_private_has_a_degrade_test():
    """Every listed private that nb_dist looks up is shown degrading below (``failures`` is
    only ever set by nb_dist, on its own exception: nothing to look up)."""
    looked_up = {p.qualified for p in _torch_compat.PRIVATES if p.use != "set on an instance"}
    assert looked_up == set(DEGRADED)


@pytest.mark.parametrize("qualified", sorted(DEGRADED))
def test_a_torch_without_a_private_degrades_and_says_which(qualified, caplog):
    with caplog.at_level("INFO", logger="nb_dist"):
        got, expected = DEGRADED[qualified]()
    assert got == expected
    said = [r.getMessage() for r in caplog.records if r.name == "nb_dist._shared._torch_compat"]
    assert any(f"has no {qualified} " in text for text in said), said
    lost = _torch_compat.registered(qualified.rpartition(".")[2])
    assert lost is not None and any(lost.without in text for text in said), said


def test_a_missing_private_degrades_and_is_logged(caplog):
    module = types.SimpleNamespace(__name__="torch.fake")
    with caplog.at_level("INFO", logger="nb_dist"):
        assert _torch_compat.replace(module, "_pg_map", lambda original: original) is False
        assert _torch_compat.lookup(module, "rendezvous", "_update_default_pg") is None
    assert vars(module) == {"__name__": "torch.fake"}  # nothing half-installed
    text = caplog.text
    assert f"torch {torch.__version__} has no torch.fake._pg_map" in text and "breakpoint" in text
    assert "torch.fake.rendezvous" in text and "torch.fake._update_default_pg" in text


def test_the_public_group_timeout_is_used_where_torch_has_it():
    """torch releases after 2.13 have ``torch.distributed.set_timeout`` (and deprecate
    ``_set_pg_timeout``): it is the one called there."""
    called = []

    def refuse(timeout, group):
        raise AssertionError("the private one was called although the public one exists")

    c10d = _fake(C10D, _pg_map={"a": None, "b": None}, _set_pg_timeout=refuse)
    c10d.set_timeout = lambda timeout, group: called.append((timeout, group))
    assert _torch_compat.set_group_timeouts(HOUR, c10d) == []
    assert called == [(HOUR, "a"), (HOUR, "b")]


def test_a_group_whose_timeout_cannot_be_set_is_logged_and_the_others_still_are(caplog):
    set_for = []

    def set_pg_timeout(timeout, group):
        if group == "mpi":
            raise RuntimeError("this backend keeps its timeout")
        set_for.append(group)

    c10d = _fake(C10D, _pg_map={"mpi": None, "gloo": None}, _set_pg_timeout=set_pg_timeout)
    with caplog.at_level("INFO", logger="nb_dist"):
        problems = _torch_compat.set_group_timeouts(HOUR, c10d)
    assert set_for == ["gloo"]
    assert problems == ["'mpi': RuntimeError: this backend keeps its timeout"]
    assert "could not lengthen a process group's timeout" in caplog.text
    assert "this backend keeps its timeout" in caplog.text


def test_the_cuda_entry_points_are_wrapped_once():
    fake = _fake_torch(_cuda_getDeviceCount=_function, _cuda_init=_function)
    assert _torch_compat.wrap_cuda_entry_points(fake, _wrapping) == [
        "_cuda_getDeviceCount",
        "_cuda_init",
    ]
    wrapped = fake._C._cuda_init
    assert _torch_compat.wrap_cuda_entry_points(fake, _wrapping) == []
    assert fake._C._cuda_init is wrapped and wrapped.__wrapped__ is _function


def test_child_failed_attributes_are_what_torchrun_code_reads():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    error = ChildFailedError.__new__(ChildFailedError)
    failure = types.SimpleNamespace(timestamp=1)
    _torch_compat.child_failed_attributes(error, "notebook_launcher", {3: failure})
    assert error.name == "notebook_launcher"
    assert error.get_first_failure() == (3, failure)


def test_group_timeouts_say_what_they_could_not_do():
    """Outside a process group there is nothing to lengthen; torch's map is simply empty."""
    assert _torch_compat.set_group_timeouts(HOUR) == []


def _lengthen_with_a_bad_value() -> list[str]:
    dist.init_process_group("gloo")
    good = _torch_compat.set_group_timeouts(HOUR)
    bad = _torch_compat.set_group_timeouts("one hour")  # type: ignore[arg-type]
    return [len(good), len(bad), bad[0] if bad else ""]


def test_a_group_timeout_that_cannot_be_set_is_reported_not_swallowed():
    """In a rank with a real group: a timedelta is taken; a value torch refuses is reported
    (and logged) for that group, where a suppressed exception used to hide it."""
    good, bad, text = notebook_launcher(_lengthen_with_a_bad_value, num_processes=1)[0]
    assert good == 0
    assert bad >= 1 and "Error" in text, text
