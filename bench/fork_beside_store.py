"""Forking beside a busy store: how often a forked rank hangs in its first store connection.

On node 0 of a launch placed by hand, other machines' ranks connect to the kernel's store
whenever they start. The store's server thread looks each new peer's name up
(``getnameinfo``) under glibc's resolver lock; a rank forked while it holds the lock inherits
it held, and its own first lookup (in the ``TCPStore`` client it creates inside
``init_process_group``) waits for ever.

A rate, not a pass/fail test. Each round, a parent process forks ``--children`` children while
two other processes keep connecting to its store (the other machine's ranks); each child then
creates a store client and sets a key, and counts as hung when it has not exited
``--hang-after`` seconds after the store is up (it is then killed). Two modes, rounds
interleaved, a fresh store each round:

- ``server first``: the store's server runs while the parent forks (nb_dist before the fix:
  ``_starter/_parts.host_store``, then the forks);
- ``forks first``: nb_dist's order (``_kernel/_local.KernelStore``): the port is opened
  (``store_socket``; early clients wait in its backlog), the children are forked, and only
  then the server starts (``serve_store``). Target: 0 hung.

Run: ``python bench/fork_beside_store.py`` (about two minutes on 2 cores; ``--quick`` under
one). Writes ``bench/results/fork_beside_store.json`` and prints markdown. The regression test
of the order, in CI: ``test_node0_forks_every_rank_before_its_store_serves`` in
``tests/test_multinode.py``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, publish

NAME = "fork_beside_store"
MODES = ("server first", "forks first")

#: A process that keeps connecting to the store at ``port``, as another machine's ranks do.
CLIENTS = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    port, until = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
    while time.monotonic() < until:
        try:
            store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5),
                                  wait_for_workers=False)
            store.set("peer", "1")
            del store
        except Exception:
            time.sleep(0.01)  # between two rounds' stores nobody listens
    """
)

#: The parent: ``rounds`` rounds of one mode; prints how many children each round left hung.
PARENT = textwrap.dedent(
    r"""
    import json, os, re, shutil, signal, socket, subprocess, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from nb_dist._starter import _parts

    mode, rounds, children = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    hang_after, clients_code = float(sys.argv[4]), sys.argv[5]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    clients = [subprocess.Popen([sys.executable, "-c", clients_code, str(port), "36000"])
               for _ in range(2)]
    time.sleep(2.0)  # their imports

    def child():
        try:
            store = dist.TCPStore("127.0.0.1", port, None, False,
                                  timedelta(seconds=2 * hang_after), wait_for_workers=False)
            store.set("child", "1")
            os._exit(0)
        except BaseException:
            os._exit(3)

    hung, where = [], []
    for _ in range(rounds):
        listener = _parts.store_socket("127.0.0.1", port)
        store = None
        if mode == "server first":
            store = _parts.serve_store(listener, "127.0.0.1", 64)
        time.sleep(0.2)  # the other machine's ranks find the port
        pids = []
        for _ in range(children):
            pid = os.fork()
            if pid == 0:
                child()
            pids.append(pid)
        if store is None:
            store = _parts.serve_store(listener, "127.0.0.1", 64)
        deadline, left = time.monotonic() + hang_after, set(pids)
        while left and time.monotonic() < deadline:
            for pid in list(left):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    left.discard(pid)
            time.sleep(0.01)
        for pid in left:
            if shutil.which("gdb"):  # where it waits: its innermost named frames
                bt = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "bt 8"],
                                    capture_output=True, text=True, timeout=60).stdout
                names = re.findall(r"^#\d+\s+(?:0x[0-9a-f]+ in )?([A-Za-z_][\w:]*)", bt, re.M)
                where.append(" < ".join(names[:4]))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        hung.append(len(left))
        del store  # the server stops; the next round opens the port again
    for c in clients:
        c.kill()
        c.wait()
    print("RESULT " + json.dumps({"hung": hung, "where": where}))
    """
)


def _mode(mode: str, rounds: int, children: int, hang_after: float) -> dict[str, Any] | None:
    """One parent's rounds: children hung per round, and where each hung child waited."""
    run = subprocess.run(
        [sys.executable, "-c", PARENT, mode, str(rounds), str(children), str(hang_after), CLIENTS],
        cwd=ROOT, capture_output=True, text=True,
        timeout=rounds * (hang_after + 5) + 120,
    )  # fmt: skip
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        print(run.stderr[-1500:], file=sys.stderr)
        return None
    import json

    return json.loads(line[len("RESULT ") :])  # type: ignore[no-any-return]


def measure(rounds: int, children: int, hang_after: float) -> dict[str, Any]:
    per_mode: dict[str, list[int]] = {mode: [] for mode in MODES}
    where: dict[str, list[str]] = {mode: [] for mode in MODES}
    errors = {mode: 0 for mode in MODES}
    batches = max(1, rounds // 5)
    for i in range(batches):  # interleaved in batches: a slow patch hits both modes
        for mode in MODES:
            began = time.monotonic()
            result = _mode(mode, rounds // batches, children, hang_after)
            if result is None:
                errors[mode] += 1
                continue
            found = [int(n) for n in result["hung"]]
            per_mode[mode].extend(found)
            where[mode].extend(result["where"])
            print(
                f"batch {i + 1}/{batches} {mode}: {sum(found)} of {children * len(found)} hung "
                f"({time.monotonic() - began:.0f} s)",
                file=sys.stderr,
            )
    summary = {
        mode: {
            "children": children * len(found),
            "hung": sum(found),
            "rounds_with_a_hang": sum(n > 0 for n in found),
            "errors": errors[mode],
            # gdb's innermost frames of each hung child (empty without gdb)
            "where": sorted(set(where[mode])),
        }
        for mode, found in per_mode.items()
    }
    return {
        "rounds": rounds, "children_per_round": children, "hang_after_s": hang_after,
        "summary": summary, "per_round": per_mode,
    }  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    lines = [
        f"Each round: {data['children_per_round']} children forked from a parent whose store "
        "two other processes keep connecting to; hung = not exited "
        f"{data['hang_after_s']:g} s after the store serves.",
        "",
        "| mode | children | hung | rate |",
        "| --- | ---: | ---: | ---: |",
    ]
    for mode, row in data["summary"].items():
        rate = row["hung"] / row["children"] if row["children"] else 0.0
        lines.append(f"| {mode} | {row['children']} | {row['hung']} | {rate:.0%} |")
    for mode, row in data["summary"].items():
        for place in row.get("where", []):
            lines.append(f"\n{mode}, a hung child waited in: `{place}`")
    return "\n".join(lines)


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    ours = data["summary"]["forks first"]
    return [
        {
            "name": "no rank forked by node 0 hangs reaching its store",
            "target": "0 hung children",
            "measured": f"{ours['hung']} of {ours['children']}",
            "met": ours["hung"] == 0 and ours["errors"] == 0 and ours["children"] > 0,
        }
    ]


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(data["summary"])
    rates = [
        100 * data["summary"][m]["hung"] / max(1, data["summary"][m]["children"]) for m in modes
    ]
    fig, ax = plt.subplots(figsize=(5, 3), dpi=120)
    ax.bar(modes, rates, color=["tab:red", "tab:blue"])
    ax.set_ylabel("forked children that hung (%)")
    ax.set_ylim(0, max(10.0, 1.2 * max(rates)))
    ax.set_title("Forking beside a busy store server")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 rounds per mode")
    parser.add_argument("--rounds", type=int, default=30, help="rounds per mode (default 30)")
    parser.add_argument("--children", type=int, default=4, help="children per round (4)")
    parser.add_argument("--hang-after", type=float, default=5.0, help="seconds (5)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rounds = 10 if args.quick else args.rounds
    data = measure(rounds, args.children, args.hang_after)
    return publish(sys.modules[__name__], data, args.out)


if __name__ == "__main__":
    sys.exit(main())
