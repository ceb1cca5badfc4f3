"""Launches on a Ray cluster: nb_dist.RayCluster on a local 2-node cluster, against Ray itself.

The cluster is ``ray.cluster_utils.Cluster``: a head and a worker node, each its own raylet
with one CPU, no dashboard, in this machine (the setup of ``tests/test_ray_cluster.py``), so
every rank runs in a node agent's process tree on its node and everything crosses Ray. Two
ranks, one per node (``placement="STRICT_SPREAD"``), gloo. Measured in this process (a plain
Python driver):

- **first launch, the cluster object made earlier**: ``RayCluster(..., num_processes=2)``
  starts the agents and fork servers in the background; the first launch 5 s later (as a
  notebook's next cell would come);
- **cold launch**: ``RayCluster(...)`` on the running cluster, then the first
  ``notebook_launcher`` of a trivial function (placement group, two agents in fresh Ray
  workers, a fork server per node that imports torch, the ranks), three times, each after
  the last one's agents are gone and the load has dropped; then **warm relaunches**:
  the same launch again, the agents and their fork servers kept;
- **print → launching process**: each rank prints lines stamped with ``time.time()`` (the
  nodes share this machine's clock); this process's ``sys.stdout`` is replaced by a writer
  that notes when each labelled line arrives: latency per line, and every line exactly once;
- **raise → error**: rank 1 raises at once (stamped); the time until ``WorkerFailedError``
  reaches the caller, and whether the root cause appears once;
- **■ with a rank blocked in a collective**: rank 1 waits in ``all_reduce`` for rank 0,
  which sleeps; SIGINT to this process's main thread once both announced themselves (a file
  each); the time until ``KeyboardInterrupt`` reaches the caller, the node agents and
  placement groups there afterwards (Ray's tables: ■ keeps the launch's two agents and its
  group), and the launch right after it, which finds them warm;
- **a 100 MB state_dict**: returned by rank 0 of a launch (time of the launch minus a
  launch returning ``None``), against ``ray.get`` of the same dict returned by a Ray task
  on the worker node (the object store's path).

- **Ray Train side by side**: ``TorchTrainer(...).fit()`` of the same trivial function, two
  workers, one per node (``STRICT_SPREAD``, one CPU each), on the same cluster in the same
  run, the first call and the later ones (``pip install "ray[train]"``, the extra
  ``bench-ray`` of ``pyproject.toml``; without it this row reads "not measured").

Live ranks: the start of
``Ranks(num_processes=2, cluster=...)`` on warm agents, and the round trip of an empty cell
(``ranks.exec("")``).
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, publish, stats

NAME = "ray_cluster"


# ----------------------------------------------------------------------------- rank functions
def trivial() -> int:
    return 1


def stamped_lines(count: int) -> None:
    import time

    import nb_dist

    rank = nb_dist.rank()
    for i in range(count):
        print(f"stamp {rank} {i} {time.time():.6f}", flush=True)
        time.sleep(0.01)


def raises_at_once() -> None:
    import time

    import nb_dist

    if nb_dist.rank() == 1:
        raise ValueError(f"raised at {time.time():.6f}")
    time.sleep(60)


def blocked(folder: str) -> None:
    import os
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.path.join(folder, f"rank{rank}"), "w") as file:
        file.write(str(os.getpid()))
    if rank == 0:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


def state_dict(megabytes: int) -> Any:
    import torch

    if __import__("nb_dist").rank() != 0:
        return None
    return {"weight": torch.ones(megabytes * 2**20 // 4)}


def nothing(megabytes: int) -> None:
    return None


def train_loop(config: dict | None = None) -> int:
    """Ray Train's worker loop: the same trivial function."""
    return 1


def ray_train_fits(root: str, calls: int) -> list[float]:
    """Seconds of each ``TorchTrainer.fit()`` (the first is the cold one); ``[]`` without
    ``ray[train]``."""
    try:
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
    except ImportError:
        return []
    seconds = []
    for call in range(calls):
        began = time.monotonic()
        TorchTrainer(
            train_loop,
            scaling_config=ScalingConfig(
                num_workers=2,
                use_gpu=False,
                placement_strategy="STRICT_SPREAD",
                resources_per_worker={"CPU": 1},
            ),
            run_config=RunConfig(storage_path=os.path.join(root, "train"), name=f"fit{call}"),
        ).fit()
        seconds.append(time.monotonic() - began)
    return seconds


# ----------------------------------------------------------------------------- the cluster
def start_cluster() -> tuple[Any, Any, str]:
    import ray
    from ray.cluster_utils import Cluster

    root = tempfile.mkdtemp(prefix="nbray", dir="/tmp")
    os.makedirs(os.path.join(root, "ray"))
    os.environ["RAY_TMPDIR"] = root
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "temp_dir": os.path.join(root, "ray"),
            "object_store_memory": 600 * 2**20,
        },
    )
    cluster.add_node(num_cpus=1, object_store_memory=600 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return ray, cluster, root


def ray_tables(ray: Any) -> tuple[int, int]:
    """(node agents alive, placement groups not removed), from Ray's own tables."""
    from ray._private import state

    agents = [
        a
        for a in state.actors().values()
        if a.get("State") != "DEAD" and "NodeAgent" in str(a.get("ActorClassName"))
    ]
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    return len(agents), len(groups)


def settle(ray: Any, within: float = 60.0) -> None:
    """Wait until no node agent or placement group is left and the load has dropped (a cold
    launch measured while the last one's Ray workers still exit measures their exit too)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if ray_tables(ray) == (0, 0) and os.getloadavg()[0] < 1.5:
            break
        time.sleep(0.5)
    time.sleep(2.0)  # Ray's workers of the killed agents exit after their actors are dead


class _Arrivals(io.TextIOBase):
    """A stdout that notes when each stamped line arrives."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self._partial = ""

    def write(self, text: str) -> int:
        now = time.time()
        self._partial += text
        *done, self._partial = self._partial.split("\n")
        self.lines.extend((now, line) for line in done)
        return len(text)


def measure(rounds: int) -> dict[str, Any]:
    import nb_dist

    ray, cluster, root = start_cluster()
    samples: dict[str, list[float]] = {
        "cold_launch": [],
        "first_launch_made_earlier": [],
        "warm_relaunch": [],
        "print_latency": [],
        "raise_to_error": [],
        "interrupt_to_stopped": [],
        "relaunch_after_stop": [],
        "state_dict_launch": [],
        "state_dict_ray_get": [],
        "ranks_start": [],
        "ranks_empty_cell": [],
        "ray_train_first_fit": [],
        "ray_train_later_fit": [],
    }
    checks: dict[str, Any] = {"lines_bad": 0, "root_cause_once": True, "left_after_stop": []}
    try:
        for _ in range(max(1, rounds // 2)):
            settle(ray)  # the last cold launch's agents and group are gone, the box is quiet
            began = time.monotonic()
            target = nb_dist.RayCluster(cluster.address, placement="STRICT_SPREAD")
            nb_dist.notebook_launcher(trivial, num_processes=2, cluster=target, output="none")
            samples["cold_launch"].append(time.monotonic() - began)
            target.close()
        for _ in range(max(1, rounds // 2)):
            settle(ray)
            # As in a notebook: the cluster object made a cell or more before the first launch.
            target = nb_dist.RayCluster(cluster.address, placement="STRICT_SPREAD", num_processes=2)
            time.sleep(5.0)
            began = time.monotonic()
            nb_dist.notebook_launcher(trivial, num_processes=2, cluster=target, output="none")
            samples["first_launch_made_earlier"].append(time.monotonic() - began)
            target.close()
        settle(ray)
        target = nb_dist.RayCluster(cluster.address, placement="STRICT_SPREAD")
        nb_dist.notebook_launcher(trivial, num_processes=2, cluster=target, output="none")
        for _ in range(rounds * 3):
            began = time.monotonic()
            nb_dist.notebook_launcher(trivial, num_processes=2, cluster=target, output="none")
            samples["warm_relaunch"].append(time.monotonic() - began)

        began = time.monotonic()
        ranks = nb_dist.Ranks(num_processes=2, cluster=target)
        samples["ranks_start"].append(time.monotonic() - began)
        for _ in range(rounds * 20):
            began = time.monotonic()
            ranks.exec("")
            samples["ranks_empty_cell"].append(time.monotonic() - began)
        ranks.close()

        main = threading.get_ident()
        count = 50
        for _ in range(rounds):
            arrivals = _Arrivals()
            real, sys.stdout = sys.stdout, arrivals
            try:
                nb_dist.notebook_launcher(stamped_lines, (count,), num_processes=2, cluster=target)
            finally:
                sys.stdout = real
            seen: dict[tuple[str, str], int] = {}
            for at, line in arrivals.lines:
                parts = line.split()
                if len(parts) == 6 and parts[2] == "stamp":
                    seen[(parts[3], parts[4])] = seen.get((parts[3], parts[4]), 0) + 1
                    samples["print_latency"].append(at - float(parts[5]))
            expected = {(str(r), str(i)) for r in (0, 1) for i in range(count)}
            checks["lines_bad"] += len(expected ^ set(seen)) + sum(n != 1 for n in seen.values())

        for _ in range(rounds):
            try:
                nb_dist.notebook_launcher(raises_at_once, num_processes=2, cluster=target)
            except nb_dist.WorkerFailedError as err:
                arrived = time.time()
                text = str(err)
                raised = float(text.split("raised at ")[1].split()[0])
                samples["raise_to_error"].append(arrived - raised)
                checks["root_cause_once"] &= text.count("Traceback (most recent call last)") == 1

        for _ in range(max(1, rounds // 2)):
            folder = tempfile.mkdtemp(prefix="nbstop", dir=root)
            pressed: list[float] = []

            def press(
                folder: str = folder, pressed: list[float] = pressed, main: int = main
            ) -> None:
                while len(os.listdir(folder)) < 2:
                    time.sleep(0.01)
                time.sleep(0.3)  # rank 1 reaches its all_reduce
                pressed.append(time.monotonic())
                signal.pthread_kill(main, signal.SIGINT)

            presser = threading.Thread(target=press, daemon=True)
            presser.start()
            try:
                nb_dist.notebook_launcher(blocked, (folder,), num_processes=2, cluster=target)
            except KeyboardInterrupt:
                samples["interrupt_to_stopped"].append(time.monotonic() - pressed[0])
            presser.join()
            checks["left_after_stop"].append(ray_tables(ray))
            began = time.monotonic()
            nb_dist.notebook_launcher(trivial, num_processes=2, cluster=target, output="none")
            samples["relaunch_after_stop"].append(time.monotonic() - began)

        megabytes = 100
        producer = ray.remote(num_cpus=0)(state_dict)
        for _ in range(rounds):
            began = time.monotonic()
            nb_dist.notebook_launcher(nothing, (megabytes,), num_processes=2, cluster=target)
            empty = time.monotonic() - began
            began = time.monotonic()
            result = nb_dist.notebook_launcher(
                state_dict, (megabytes,), num_processes=2, cluster=target
            )
            samples["state_dict_launch"].append(time.monotonic() - began - empty)
            assert result[0]["weight"].numel() == megabytes * 2**20 // 4
            del result
            ref = producer.options(
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    cluster.list_all_nodes()[1].node_id, soft=False
                )
            ).remote(megabytes)
            ray.wait([ref], fetch_local=False)  # produced on the worker node, not yet here
            began = time.monotonic()
            value = ray.get(ref)
            samples["state_dict_ray_get"].append(time.monotonic() - began)
            del value, ref
        target.close()
        checks["left_at_end"] = ray_tables(ray)
        settle(ray)  # Ray Train on a quiet cluster, as nb_dist's cold launches were
        fits = ray_train_fits(root, 1 + max(1, rounds // 2))
        samples["ray_train_first_fit"] = fits[:1]
        samples["ray_train_later_fit"] = fits[1:]
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {
        "rounds": rounds,
        "samples": samples,
        "stats": {k: stats(v) for k, v in samples.items()},
        "checks": checks,
        "versions": _versions(),
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("ray", "torch", "pyarrow"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


def markdown(data: dict) -> str:
    s, c = data["stats"], data["checks"]
    rows = [
        ("cold launch, 2 ranks (agents, fork servers, ranks)", "cold_launch", 1),
        (
            "first launch, RayCluster(num_processes=2) made 5 s before",
            "first_launch_made_earlier",
            1,
        ),
        ("warm relaunch, 2 ranks", "warm_relaunch", 1000),
        ("print → launching process, per line", "print_latency", 1000),
        ("a rank raises → WorkerFailedError in the caller", "raise_to_error", 1000),
        ("■ with a rank in a collective → KeyboardInterrupt", "interrupt_to_stopped", 1000),
        ("the launch right after ■ (agents kept warm)", "relaunch_after_stop", 1000),
        ("100 MB state_dict returned by a launch (extra time)", "state_dict_launch", 1000),
        ("100 MB state_dict by ray.get from the worker node", "state_dict_ray_get", 1000),
        ("Ranks(num_processes=2, cluster=...) start (agents warm)", "ranks_start", 1000),
        ("an empty cell, ranks.exec(''), round trip", "ranks_empty_cell", 1000),
        ("Ray Train: TorchTrainer.fit(), the first call", "ray_train_first_fit", 1),
        ("Ray Train: TorchTrainer.fit(), later calls", "ray_train_later_fit", 1),
    ]
    lines = [
        "| on a local 2-node Ray cluster, 2 ranks | median | p95 | n |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, key, scale in rows:
        unit = "s" if scale == 1 else "ms"
        st = s[key]
        if not st.get("n"):
            lines.append(f"| {label} | not measured | | 0 |")
            continue
        lines.append(
            f"| {label} | {st['median'] * scale:.3g} {unit} | {st['p95'] * scale:.3g} {unit} "
            f"| {st['n']} |"
        )
    lines.append("")
    lines.append(
        f"Lines lost, doubled or unexpected: {c['lines_bad']}; root cause shown once: "
        f"{c['root_cause_once']}; (agents, placement groups) after each ■ (kept warm): "
        f"{c['left_after_stop']}, at the end: {c.get('left_at_end')}. Both sides in one run "
        f"on one machine: {', '.join(f'{k} {v}' for k, v in data['versions'].items())}."
    )
    return "\n".join(lines)


def targets(data: dict) -> list[dict]:
    s, c = data["stats"], data["checks"]
    out = []

    def add(name: str, target: str, measured: str, met: bool | None) -> None:
        out.append({"name": name, "target": target, "measured": measured, "met": met})

    cold = s["cold_launch"].get("median")
    train = s["ray_train_first_fit"].get("median")
    versus = "Ray cluster: cold launch vs Ray Train's first fit()"
    if train:
        measured = f"{cold:.2f} s ({cold / train:.2f}x of {train:.1f} s)"
        add(versus, "<= 0.25x, same run", measured, cold <= 0.25 * train)
    else:
        add(versus, "<= 0.25x, same run", f"{cold:.2f} s (ray[train] not installed)", None)
    early = s["first_launch_made_earlier"].get("median")
    versus = "Ray cluster: first launch, cluster made 5 s before, vs Ray Train's first fit()"
    if train and early is not None:
        measured = f"{early:.3f} s ({early / train:.3f}x of {train:.1f} s)"
        add(versus, "<= 0.25x, same run", measured, early <= 0.25 * train)
    warm = s["warm_relaunch"].get("median")
    add("Ray cluster: warm relaunch", "<= 0.3 s", f"{warm:.3f} s", warm <= 0.3)
    p95 = s["print_latency"].get("p95")
    bad = c["lines_bad"]
    add("Ray cluster: print -> launching cell", "p95 <= 50 ms, every line once",
        f"p95 {p95 * 1000:.1f} ms, {bad} bad", p95 <= 0.05 and bad == 0)  # fmt: skip
    raised = s["raise_to_error"].get("median")
    once = c["root_cause_once"]
    add("Ray cluster: raise -> error in the cell", "<= 1 s, root cause once",
        f"{raised:.3f} s, once={once}", raised <= 1 and once)  # fmt: skip
    stop = s["interrupt_to_stopped"].get("p95")
    kept = [tuple(x) for x in c["left_after_stop"]]
    add("Ray cluster: stop with a rank in a collective", "<= 2 s, the 2 agents and 1 PG kept",
        f"{stop:.2f} s, kept {kept}", stop <= 2 and all(x == (2, 1) for x in kept))  # fmt: skip
    after = s["relaunch_after_stop"].get("median")
    add("Ray cluster: the launch after ■", "<= 0.3 s (a warm relaunch)", f"{after:.3f} s",
        after <= 0.3)  # fmt: skip
    ours, theirs = s["state_dict_launch"].get("median"), s["state_dict_ray_get"].get("median")
    add("Ray cluster: 100 MB state_dict vs ray.get", "<= 1.5x ray.get",
        f"{ours / theirs:.2f}x ({ours:.2f} s vs {theirs:.2f} s)", ours <= 1.5 * theirs)  # fmt: skip
    start, cell = s["ranks_start"].get("median"), s["ranks_empty_cell"].get("median")
    add("Ray cluster: Ranks(cluster=...) start / empty cell", "<= 2 s / p50 <= 3 ms",
        f"{start:.2f} s / {cell * 1000:.2f} ms", start <= 2 and cell <= 0.003)  # fmt: skip
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in data["samples"] if data["samples"][k] and k != "cold_launch"]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.boxplot([[v * 1000 for v in data["samples"][k]] for k in keys], orientation="horizontal")
    ax.set_yticks(range(1, len(keys) + 1), keys, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("ms")
    ax.set_title("nb_dist on a local 2-node Ray cluster")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    data = measure(2 if args.quick else 6)
    return publish(sys.modules[__name__], data, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
