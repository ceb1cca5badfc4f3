"""The seam a cluster plugs into: a launch whose ranks run on other machines.

Runs in the kernel. ``notebook_launcher(..., cluster=c)`` hands the plan to ``c`` at two
points and changes nothing else: :meth:`ClusterBackend.decide` finishes the plan (instead of
the local devices, threads and fork checks: the cluster's placement, its nodes, the function
shipped by value) and :meth:`ClusterBackend.run_attempt` runs one attempt (instead of the local
store and processes: the cluster's agents start the ranks, and their pipes are forwarded into
local ones, so the supervisor, the output, the diagnosis and the results are the local
ones). After an interrupt the launcher calls :meth:`ClusterBackend.interrupted` so the
cluster checks what it keeps for the next launch; live ranks start through
:meth:`ClusterBackend.session_host`.
``nb_dist._cluster.RayCluster`` is the one implementation;
this module names only the protocol, so the kernel never imports a cluster engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ._observer import Observer
    from ._options import LaunchOptions
    from ._output import OutputRouter
    from ._plan import LaunchPlan
    from ._supervisor import AttemptResult, RankHost


class ClusterBackend(Protocol):
    """Where a launch's ranks run when they do not run on this machine."""

    def decide(self, plan: LaunchPlan, options: LaunchOptions) -> LaunchPlan:
        """The final plan for the checked arguments; raises what refuses the launch."""
        ...

    def run_attempt(
        self, plan: LaunchPlan, number: int, router: OutputRouter, observer: Observer | None
    ) -> tuple[AttemptResult, int]:
        """Run attempt ``number``: its result and the rendezvous port."""
        ...

    def session_host(self, plan: LaunchPlan, number: int) -> tuple[list[dict[str, str]], RankHost]:
        """Where live ranks (``nb_dist.Ranks``) run on the cluster: each rank's environment
        and the host their session supervisor starts and ends them through."""
        ...

    def interrupted(self) -> None:
        """The launch was interrupted (its ranks are stopped): keep what is still sound for
        the next launch, give back what is not."""
        ...
