"""The one seam between a launch and where its ranks run: the :class:`Transport`.

Runs in the kernel. Every launch and every set of live ranks goes through a transport at the
same three points, and nothing else in the kernel asks where the ranks run:

- :meth:`Transport.decide` says where the checked launch's ranks go (this machine: the
  kernel's state and its devices; a cluster: its placement and nodes, the function shipped
  by value), and :func:`prepare` applies ``_plan.plan_on``'s rules to that, for both;
- :meth:`Transport.open` gives one attempt's ranks (or a live session's) their
  environments and places (``_attempt_setup.Place``, decided there once per attempt), with
  the rendezvous store opened for them, and the ``RankHost`` the
  kernel's own ``Supervisor`` starts and ends them through: the launch and ``nb_dist.Ranks``
  build that supervisor themselves, so the loop, the output, the diagnosis and the results
  are the same for every transport;
- :meth:`Transport.interrupted` lets the transport keep, after ■, what is sound for the
  next launch.

Two implementations: ``_local.LocalTransport`` (this machine, the default) and
``nb_dist._cluster.RayCluster`` (``cluster=``). This module names only the protocol and picks
one (:func:`transport_for`), so the kernel never imports a cluster engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from ._arguments import Asked, LaunchOptions, check_arguments
from ._attempt_setup import Place
from ._local import LocalTransport
from ._plan import LaunchPlan, Where, plan_on

if TYPE_CHECKING:
    from ._supervisor import RankHost


@runtime_checkable
class Transport(Protocol):
    """Where a launch's ranks run, and what starting them there takes."""

    def decide(self, asked: Asked) -> Where:
        """Where the ranks of the checked launch go (how many, on which nodes, GPUs or not,
        what ``"fork"`` becomes there); raises what refuses the launch."""
        ...

    def open(
        self, plan: LaunchPlan, attempt: int
    ) -> tuple[list[dict[str, str]], list[Place], RankHost]:
        """The ranks of ``attempt`` (0, then one more per restart; or a live session's):
        each one's environment (the rendezvous store opened for them) and its place (its
        node's ranks, as written in that environment), and the host the supervisor starts
        them through; the host's ``close`` frees what this opened."""
        ...

    def interrupted(self) -> None:
        """The launch was interrupted (its ranks are stopped): keep what is still sound for
        the next launch, give back what is not."""
        ...


def transport_for(cluster: object) -> Transport:
    """The transport of ``cluster=``: ``None`` is this machine; anything else must be a
    cluster object such as ``nb_dist.RayCluster(...)``."""
    if cluster is None:
        return LocalTransport()
    if not isinstance(cluster, Transport):
        raise TypeError(
            f"cluster={cluster!r} is not a cluster to launch on. Pass "
            "cluster=nb_dist.RayCluster(...) to run the ranks on a Ray cluster, or leave "
            "cluster=None to run them on this machine."
        )
    return cluster


def prepare(
    function: Callable[..., Any],
    args: Sequence[Any],
    options: LaunchOptions,
    cluster: object,
    session: bool = False,
) -> tuple[Transport, LaunchPlan]:
    """The one way a launch (and a start of live ranks) is planned: every argument checked
    (``_arguments``), the transport of ``cluster=`` says where the ranks go, and
    ``_plan.plan_on`` applies the rules every transport shares. Nothing has started."""
    asked = check_arguments(function, args, options, session=session)
    transport = transport_for(cluster)  # where the ranks run: this machine or a cluster's
    return transport, plan_on(asked, transport.decide(asked))


_Supervisor = TypeVar("_Supervisor")


def open_supervised(
    transport: Transport,
    plan: LaunchPlan,
    attempt: int,
    supervisor_for: Callable[[list[dict[str, str]], list[Place], RankHost], _Supervisor],
) -> tuple[_Supervisor, int]:
    """The ranks of ``attempt`` opened through ``transport`` (their environments and places,
    the store opened) and the supervisor built over them (``supervisor_for(envs, places,
    host)``: a launch's, or a live session's); the host is closed again if the supervisor
    cannot be built. The supervisor, and the rendezvous port (0 where there is none)."""
    envs, places, host = transport.open(plan, attempt)
    try:
        supervisor = supervisor_for(envs, places, host)
    except BaseException:
        host.close()
        raise
    return supervisor, int(envs[0].get("MASTER_PORT", 0)) if envs else 0
