"""A launch's arguments: as the caller gave them (:class:`LaunchOptions`), and checked, once,
in one documented order (:class:`Asked`).

``notebook_launcher`` and ``Ranks`` build a :class:`LaunchOptions` by keyword from their
signatures (no option travels by position, so two options of the same type cannot be
swapped by a caller). :func:`check_arguments` turns it into what they asked, checked, before
any transport is consulted (the first problem found is the one reported):

1. a launch from inside a rank of a launch;
2. each argument on its own, in the order of the signature (types, ranges, choices);
3. combinations of arguments (multi-node needs a port and no restarts).

What is left for where the ranks run (how many, threads, start method, the ``"auto"``
rendezvous timeout) stays as asked: the transport decides where they go and
``_plan.plan_on`` the rest (``_transport.prepare``).
Runs in the kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._shared._precision import normalize_mixed_precision
from . import _preflight
from ._output import DEFAULT_PREFIX, OUTPUT_MODES, RICH_OUTPUT_MODES

START_METHODS = ("fork", "spawn", "forkserver")
DEVICES = ("auto", "cpu", "cuda")
#: ``debug=``: ``None`` (no debugger), or keep the failing rank for a post-mortem.
DEBUG_MODES = ("postmortem",)


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """The options of ``notebook_launcher`` after ``function`` and ``args``, unchecked.

    Defaults are the launcher's; ``tests/test_shared_rules.py`` keeps them equal to its
    signature. ``cluster=`` is not one of them: it says where the ranks run, the launch's
    ``_transport.Transport``, which decides the plan checked from these options (and reads
    the plan only).
    """

    num_processes: int | None = None
    mixed_precision: str = "no"
    use_port: int | str | None = None
    master_addr: str = "127.0.0.1"
    node_rank: int = 0
    num_nodes: int = 1
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_conf: dict[str, Any] | None = None
    rdzv_id: str = "none"
    max_restarts: int = 0
    monitor_interval: float = 0.1
    log_line_prefix_template: str | None = None
    start_method: str = "fork"
    timeout: float | None = None
    output: str = "all"
    init_process_group: bool = False
    device: str = "auto"
    threads_per_process: int | None = None
    hang_notice_after: float | None = 10.0
    monitor: bool = False
    rendezvous_timeout: float | str | None = "auto"
    warm_imports: bool = True
    rich_output: str | int | Sequence[int] = "rank0"
    debug: str | None = None


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What the caller asked that no transport changes: a launch's plan carries it as is."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    node_rank: int
    master_addr: str
    port: int | None  # None: the kernel's store picks a free one per attempt
    rdzv_id: str
    max_restarts: int
    mixed_precision: str
    device: str
    init_process_group: bool
    output: str
    rich_output: str | frozenset[int]
    prefix: str
    timeout: float | None
    hang_notice_after: float | None
    poll_interval: float
    monitor: bool
    debug: str | None = None  # "postmortem": keep the failing rank for the notebook's pdb
    session: bool = False  # live ranks (nb_dist.Ranks): ranks serve tasks


@dataclass(frozen=True, kw_only=True)
class Asked(Settings):
    """A launch's arguments, checked: the settings, and what the transport decides from."""

    num_processes: int | None  # None: one per GPU here
    threads_per_process: int | None
    start_method: str
    num_nodes: int
    #: The rendezvous timeout asked for; ``rendezvous_auto``: ``_plan.auto_rendezvous``'s
    #: (``"auto"`` and no ``rdzv_conf`` timeout).
    rendezvous_timeout: float | None
    rendezvous_auto: bool
    warm_imports: bool
    #: The options given that place a launch by hand on machines (``use_port``,
    #: ``master_addr``, ``node_rank``, ``num_nodes``, ``rdzv_endpoint``), which a transport
    #: that places the ranks itself refuses by name.
    placed_by_hand: tuple[str, ...] = ()
    notices: tuple[str, ...] = ()


def check_arguments(
    function: Callable[..., Any],
    args: Sequence[Any],
    options: LaunchOptions,
    session: bool = False,
) -> Asked:
    """Steps 1 and 2: not inside a rank, then each argument on its own, in the order of the
    signature; step 3, the combinations. ``session``: for live ranks (``nb_dist.Ranks``)."""
    o = options
    _preflight.check_not_nested()  # 1. Not inside a rank.
    check_function(function)  # 2. Each argument.
    call_args = check_args(args)
    if o.num_processes is not None:
        check_positive_int("num_processes", o.num_processes, _NPROCS_HINT)
    mixed = normalize_mixed_precision(o.mixed_precision)
    nodes = check_positive_int("num_nodes", o.num_nodes, _NODES_HINT)
    node = check_node_rank(o.node_rank, nodes)
    addr, port = _rendezvous_address(o.rdzv_endpoint, o.master_addr, o.use_port)
    _check_rdzv_backend(o.rdzv_backend, nodes)
    conf_timeout, notices = read_rdzv_conf(o.rdzv_conf)
    restarts = _non_negative_int("max_restarts", o.max_restarts)
    poll = check_seconds("monitor_interval", o.monitor_interval, default=0.1)
    method = check_choice("start_method", o.start_method, START_METHODS)
    limit = check_seconds("timeout", o.timeout)
    output_mode = check_choice("output", o.output, OUTPUT_MODES)
    _check_bool("init_process_group", o.init_process_group)
    device = check_choice("device", o.device, DEVICES)
    if o.threads_per_process is not None:
        check_positive_int("threads_per_process", o.threads_per_process, _THREADS_HINT)
    hang_after = check_seconds("hang_notice_after", o.hang_notice_after)
    _check_bool("monitor", o.monitor)
    rdzv_auto = o.rendezvous_timeout == "auto" and conf_timeout is None  # the plan's rule
    rdzv_limit = None if rdzv_auto else rendezvous_limit(o.rendezvous_timeout, conf_timeout)
    _check_bool("warm_imports", o.warm_imports)
    rich = _rich_output(o.rich_output)
    debug = o.debug
    if debug is not None:
        debug = check_choice("debug", debug, DEBUG_MODES)
    _check_multi_node(nodes, port, restarts)  # 3. Combinations.
    return Asked(
        function=function, args=call_args, node_rank=node, master_addr=addr, port=port,
        rdzv_id=str(o.rdzv_id), max_restarts=restarts, mixed_precision=mixed, device=device,
        init_process_group=o.init_process_group, output=output_mode, rich_output=rich,
        prefix=o.log_line_prefix_template or DEFAULT_PREFIX, timeout=limit,
        hang_notice_after=hang_after, poll_interval=poll or 0.1, monitor=o.monitor,
        debug=debug, session=session, num_processes=o.num_processes,
        threads_per_process=o.threads_per_process, start_method=method, num_nodes=nodes,
        rendezvous_timeout=rdzv_limit, rendezvous_auto=rdzv_auto, warm_imports=o.warm_imports,
        placed_by_hand=_placed_by_hand(o), notices=tuple(notices),
    )  # fmt: skip


def _placed_by_hand(options: LaunchOptions) -> tuple[str, ...]:
    defaults = LaunchOptions()
    names = ("use_port", "master_addr", "node_rank", "num_nodes", "rdzv_endpoint")
    return tuple(n for n in names if getattr(options, n) != getattr(defaults, n))


_NPROCS_HINT = "For CPU training on a laptop, 2 to 4 is a good choice."
_NODES_HINT = "Use num_nodes=1 for a launch on this machine only."
_THREADS_HINT = "Or leave it unset for cores / ranks."


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False.")


def _check_multi_node(num_nodes: int, port: int | None, restarts: int) -> None:
    if num_nodes > 1 and port is None:
        raise ValueError(
            f"use_port=None with num_nodes={num_nodes}: every machine must know the port in "
            "advance, so a multi-node launch needs an explicit port. Pass the same use_port "
            "(for example use_port=29500) on every node."
        )
    if restarts and num_nodes > 1:
        raise ValueError(
            f"max_restarts={restarts} with num_nodes={num_nodes}: restarts are coordinated on "
            "one machine only. Use max_restarts=0, or torchrun with an elastic rendezvous "
            "(--rdzv-backend=c10d --max-restarts=N) for fault-tolerant multi-node jobs."
        )


def _check_rdzv_backend(backend: object, num_nodes: int) -> None:
    """``"static"`` always; ``"c10d"`` on one machine, where it gives the same ranks."""
    name = backend.lower() if isinstance(backend, str) else None
    if name == "static" or (name == "c10d" and num_nodes == 1):
        # On one machine a c10d rendezvous assigns the same ranks a static one does (one
        # agent, local ranks in order), so the kernel-hosted static store stands in for it.
        return
    if name == "c10d":
        raise ValueError(
            f"rdzv_backend='c10d' with num_nodes={num_nodes}: an elastic rendezvous across "
            "machines (nodes joining and leaving, ranks assigned on arrival) needs torchrun's "
            "agent on every machine, which a notebook launch does not have. Use "
            "rdzv_backend='static' with the same master_addr and use_port on every machine "
            "(each with its own node_rank), or run a script with torchrun --rdzv-backend=c10d."
        )
    raise ValueError(
        f"rdzv_backend={backend!r} is not supported. Use 'static' (the default) or, on one "
        "machine, 'c10d' (the same ranks); for other elastic rendezvous backends run a script "
        "with torchrun."
    )


# rdzv_conf keys that mean "how long to wait for the ranks to join" (torchrun's names).
_RDZV_TIMEOUT_KEYS = ("join_timeout", "timeout")


def rendezvous_limit(
    rendezvous_timeout: float | str | None, conf_timeout: float | None
) -> float | None:
    """``rendezvous_timeout`` checked: ``"auto"`` is ``rdzv_conf``'s timeout here (without
    one, the plan's, ``_plan.auto_rendezvous``, from what the transport says)."""
    if rendezvous_timeout == "auto":
        rendezvous_timeout = conf_timeout
    return check_seconds("rendezvous_timeout", rendezvous_timeout)


def read_rdzv_conf(conf: object) -> tuple[float | None, list[str]]:
    """The rendezvous timeout an Accelerate-style ``rdzv_conf`` asks for, and notices."""
    if conf is None or conf == {}:
        return None, []
    if not isinstance(conf, dict):
        raise TypeError(
            f"rdzv_conf={conf!r} must be a dict, e.g. rdzv_conf={{'timeout': 60}}, or None."
        )
    timeout = None
    for key in _RDZV_TIMEOUT_KEYS:
        if key in conf:
            timeout = check_seconds(f"rdzv_conf[{key!r}]", conf[key])
            break
    ignored = sorted(str(k) for k in conf if k not in _RDZV_TIMEOUT_KEYS)
    notices = []
    if ignored:
        notices.append(
            f"rdzv_conf keys {', '.join(ignored)} configure torchrun's elastic agent and are "
            "ignored here; 'timeout'/'join_timeout' set rendezvous_timeout."
        )
    return timeout, notices


def _rich_output(value: object) -> str | frozenset[int]:
    if isinstance(value, str) and value.lower() in RICH_OUTPUT_MODES:
        return value.lower()
    ranks = [value] if isinstance(value, int) else value
    if (
        isinstance(ranks, (list, tuple, set, frozenset))
        and ranks
        and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)
    ):
        return frozenset(ranks)
    raise ValueError(
        f"rich_output={value!r} is not supported. Use 'rank0', 'all', 'none', a rank such as 1, "
        "or a list of ranks such as [0, 1]."
    )


def _rendezvous_address(
    endpoint: object,
    master_addr: object,
    use_port: object,
) -> tuple[str, int | None]:
    if not isinstance(master_addr, str) or not master_addr:
        raise TypeError(f"master_addr={master_addr!r} must be a host name or IP address string.")
    port = check_port(use_port)
    if endpoint:
        if not isinstance(endpoint, str) or ":" not in endpoint:
            raise ValueError(
                f"rdzv_endpoint={endpoint!r} must look like 'host:port', e.g. '10.0.0.1:29500'. "
                "Or pass master_addr and use_port instead."
            )
        host, _, endpoint_port = endpoint.rpartition(":")
        master_addr = host.strip("[]")
        try:
            port = check_port(endpoint_port)
        except ValueError:
            raise ValueError(
                f"rdzv_endpoint={endpoint!r} has no valid port after the ':'. Use 'host:port' "
                "with a port from 1024 to 65535, e.g. '10.0.0.1:29500'."
            ) from None
    return master_addr, port


def _non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be a whole number, 0 or more.")
    return value


def check_function(function: object) -> None:
    if not callable(function):
        raise TypeError(
            f"function={function!r} (a {type(function).__name__}) is not callable. Pass the "
            "function itself, without calling it: notebook_launcher(train, args=(...)), "
            "not notebook_launcher(train(...))."
        )


def check_args(args: object) -> tuple[Any, ...]:
    if isinstance(args, (tuple, list)):
        return tuple(args)
    raise TypeError(
        f"args={args!r} (a {type(args).__name__}) must be a tuple or list of the function's "
        f"positional arguments. For one argument write args=({args!r},) with the comma."
    )


def check_positive_int(name: str, value: object, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise (ValueError if isinstance(value, int) and not isinstance(value, bool) else TypeError)(
            f"{name}={value!r} must be a positive whole number (1, 2, 3, ...). {hint}"
        )
    return value


def check_node_rank(node_rank: object, num_nodes: int) -> int:
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or node_rank < 0:
        is_int = isinstance(node_rank, int) and not isinstance(node_rank, bool)
        raise (ValueError if is_int else TypeError)(
            f"node_rank={node_rank!r} must be a whole number from 0 to num_nodes - 1 "
            "(0 on the first machine)."
        )
    if node_rank >= num_nodes:
        raise ValueError(
            f"node_rank={node_rank} is not less than num_nodes={num_nodes}: nodes are numbered "
            f"0 to {num_nodes - 1}. Give every machine its own node_rank in that range."
        )
    return node_rank


def check_port(use_port: object) -> int | None:
    """Validate ``use_port`` (int or numeric str, as Accelerate accepts); ``None`` = automatic."""
    if use_port is None:
        return None
    port: int | None = None
    if isinstance(use_port, int) and not isinstance(use_port, bool):
        port = use_port
    elif isinstance(use_port, str) and use_port.strip().isdigit():
        port = int(use_port.strip())
    if port is None or not 1 <= port <= 65535:
        raise ValueError(
            f"use_port={use_port!r} is not a valid TCP port. Use a number from 1024 to 65535 "
            "(as an int or a string such as '29500'), or leave use_port unset to let the "
            "launcher pick a free port."
        )
    return port


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value.lower() in choices:
        return value.lower()
    raise ValueError(
        f"{name}={value!r} is not supported. Use one of {', '.join(repr(c) for c in choices)}."
    )


def check_seconds(name: str, value: object, default: float | None = None) -> float | None:
    """A positive number of seconds; ``None`` allowed unless ``default`` is given (then it
    says what leaving the argument unset gives)."""
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        fix = "or None" if default is None else f"or leave it unset for {default:g}"
        raise ValueError(f"{name}={value!r} must be a positive number of seconds, {fix}.")
    return float(value)
