"""The launch's placement group: one bundle per node, refused within seconds when it cannot fit.

Runs in the kernel. Ray waits forever for a placement group the cluster cannot hold; a
notebook should not. :func:`reserve` first compares what is asked with what each live node
has (an impossible request is refused at once, naming both), then waits a bounded time for
Ray to place it (the resources exist but others hold them: refused after
``placement_timeout`` s, naming what is free now). A group that was not placed is removed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._connect import ClusterError

Bundle = dict[str, float]
#: Ray's strategies (``ray.util.placement_group``).
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def bundles(nprocs: int, per_node: int, per_rank: Mapping[str, float]) -> list[Bundle]:
    """One bundle per node: ``per_node`` ranks' resources each, the last one what is left."""
    counts = [per_node] * (nprocs // per_node) + ([nprocs % per_node] if nprocs % per_node else [])
    return [{key: value * count for key, value in per_rank.items()} for count in counts]


def _fits(bundle: Mapping[str, float], node: Mapping[str, float]) -> bool:
    return all(node.get(key, 0.0) >= value for key, value in bundle.items())


def infeasible(
    asked: Sequence[Bundle], strategy: str, nodes: Sequence[Mapping[str, float]]
) -> str | None:
    """Why the live ``nodes`` (their total resources) can never hold ``asked``; ``None`` if
    they might (then only free resources are missing, and Ray's own placement decides)."""
    if strategy == "STRICT_PACK":
        total = {key: sum(b.get(key, 0.0) for b in asked) for b in asked for key in b}
        if not any(_fits(total, node) for node in nodes):
            return f"STRICT_PACK needs one node with {_describe(total)}"
        return None
    if strategy == "STRICT_SPREAD":
        free = list(nodes)
        for bundle in sorted(asked, key=lambda b: sorted(b.items()), reverse=True):
            node = next((n for n in free if _fits(bundle, n)), None)
            if node is None:
                return f"STRICT_SPREAD needs {len(asked)} different nodes, each with " + (
                    f"{_describe(asked[0])}"
                )
            free.remove(node)
        return None
    for bundle in asked:
        if not any(_fits(bundle, node) for node in nodes):
            return f"no node has {_describe(bundle)} for one node's ranks"
    keys = {key for bundle in asked for key in bundle}
    total = {key: sum(b.get(key, 0.0) for b in asked) for key in keys}
    have = {key: sum(n.get(key, 0.0) for n in nodes) for key in keys}
    if not _fits(total, have):
        return f"the launch needs {_describe(total)} in all, the cluster has {_describe(have)}"
    return None


def reserve(ray: Any, asked: list[Bundle], strategy: str, timeout: float) -> Any:
    """A placement group holding ``asked``, placed; :class:`ClusterError` within ``timeout``
    s if it cannot be."""
    from ray.util.placement_group import placement_group, remove_placement_group

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    why = infeasible(asked, strategy, nodes)
    if why is not None:
        raise ClusterError(
            f"The cluster cannot hold this launch: it asks for {_ask(asked, strategy)}, and "
            f"{why}. The cluster has {_nodes(nodes)}. Ask for fewer processes "
            "(num_processes, processes_per_node) or resources (resources_per_rank), another "
            "placement, or add nodes."
        )
    group = placement_group(asked, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout)
    except BaseException as exc:
        remove_placement_group(group)
        if not isinstance(exc, ray.exceptions.GetTimeoutError):
            raise
        free = ray.available_resources()
        raise ClusterError(
            f"The cluster did not place this launch within {timeout:g} s: it asks for "
            f"{_ask(asked, strategy)}, and only {_describe(free)} is free now (other jobs or "
            "launches hold the rest). Wait for them to finish, ask for fewer processes or "
            "resources, or raise RayCluster(placement_timeout=...)."
        ) from None
    return group


def release(group: Any) -> None:
    """Remove the placement group (its actors die with it)."""
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)


def _describe(resources: Mapping[str, float]) -> str:
    shown = {k: v for k, v in resources.items() if k in ("CPU", "GPU") or not _internal(k)}
    return ", ".join(f"{_number(v)} {k}" for k, v in sorted(shown.items())) or "nothing"


def _internal(key: str) -> bool:
    return key.startswith("node:") or key in ("memory", "object_store_memory") or "_group_" in key


def _number(value: float) -> str:
    return f"{value:g}"


def _ask(asked: Sequence[Bundle], strategy: str) -> str:
    return f"{len(asked)} bundle(s) of {_describe(asked[0])} placed {strategy}"


def _nodes(nodes: Sequence[Mapping[str, float]]) -> str:
    listed = "; ".join(f"node {i}: {_describe(node)}" for i, node in enumerate(nodes))
    return f"{len(nodes)} live node(s) ({listed})"
