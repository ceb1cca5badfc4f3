"""A live-ranks session written out as a ``torchrun`` script (``Ranks.export``).

The session records what it ran, in order: cells (with the ranks they ran on), functions
called with their arguments, values pushed. The script starts the process group as the
session did, defines what the cells use from the kernel's namespace at the start (imports,
functions and classes by their source, plain values by ``repr``), then replays each step;
a cell's last expression is printed with its rank, as the session showed it.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any

from .._kernel._plan import LaunchPlan
from .._kernel._tracebacks import ipython_shell
from ._per_rank import PerRank

# Every rank reaches the end before any tears its group down; then it leaves at once, as
# nb_dist's ranks do: torch's gloo can abort a rank while the interpreter shuts down, after
# all the work is done ("terminate called without an active exception").
_END = """
dist.barrier()
dist.destroy_process_group()
# Leave at once: torch's gloo can abort a rank in the interpreter's shutdown.
import os, sys  # noqa: E401
sys.stdout.flush()
os._exit(0)
"""

_HEADER = '''\
"""Exported from an nb_dist live-ranks session ({nprocs} ranks).

Run it with:  torchrun --nproc-per-node {nprocs} {name}
"""
import torch.distributed as dist

dist.init_process_group("{backend}")  # the session's process group


def _show(value):
    """What the session showed for a cell's last expression, labelled by rank."""
    if value is not None:  # one write: the ranks share stdout, unbuffered under torchrun
        print(f"[rank {{dist.get_rank()}}] {{value!r}}\\n", end="", flush=True)

'''


@dataclass
class History:
    """What a session ran, in order, and the kernel's namespace when it started."""

    steps: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # everything the steps run, to scan
    kernel: dict[str, Any] = field(default_factory=dict)

    def started(self, plan: LaunchPlan) -> None:
        shell = ipython_shell()
        user_ns = getattr(shell, "user_ns", None)
        if isinstance(user_ns, dict) and not self.kernel:
            self.kernel = dict(user_ns)
        if self.steps or self.sources:
            self.steps.append("# --- the session restarted here: the ranks' state was reset\n")

    def executed(self, source: str, ranks: list[int], nprocs: int | None = None) -> None:
        body = _show_last(source)
        self.sources.append(source)
        if nprocs is None or len(ranks) != nprocs:
            listed = ", ".join(map(str, ranks))
            header = f"# --- cell on rank {listed}\n"
            body = f"if dist.get_rank() in ({listed},):\n" + textwrap.indent(body, "    ")
        else:
            header = "# --- cell\n"
        self.steps.append(header + body)

    def called(self, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = getattr(function, "__name__", "")
        try:
            source = textwrap.dedent(inspect.getsource(function))
        except (OSError, TypeError):
            source = ""
        values = [_literal(a, None) for a in args] + [_literal(v, None) for v in kwargs.values()]
        if not name.isidentifier() or not source:
            what = "a lambda" if name == "<lambda>" else f"{type(function).__name__} {name}"
            self.steps.append(
                f"# --- run({what}, ...): it has no source under a name to call; "
                "write it as a def in the notebook to export it\n"
            )
            return
        self.sources.append(source)
        if any(value is None for value in values):
            call = (
                f"# {name}(...) was called with values that cannot be written as source: "
                "call it here with them"
            )
        else:
            keys = [f"{k}=" for k in kwargs]
            parts = values[: len(args)] + [
                k + v for k, v in zip(keys, values[len(args) :], strict=True)
            ]
            call = f"_show({name}({', '.join(parts)}))"
        self.steps.append(f"# --- run({name}, ...)\n{source}\n{call}\n")

    def pushed(self, values: dict[str, Any]) -> None:
        lines = ["# --- push"]
        for name, value in values.items():
            per_rank = value.values if isinstance(value, PerRank) else None
            if per_rank is not None:
                items = [_literal(v, None) for v in per_rank]
                line = f"{name} = [{', '.join(i or '' for i in items)}][dist.get_rank()]"
                ok = all(item is not None for item in items)
            else:
                literal = _literal(value, None)
                line, ok = f"{name} = {literal}", literal is not None
            if not ok:
                line = f"# {name} was pushed as a value that cannot be written as source: define it"
            lines.append(line)
        self.steps.append("\n".join(lines) + "\n")

    def script(self, plan: LaunchPlan, name: str) -> str:
        head = _HEADER.format(nprocs=plan.nprocs, backend=plan.backend, name=name)
        end = _END
        return head + self._definitions() + "\n" + "\n".join(self.steps) + end

    def _definitions(self) -> str:
        """The kernel's names that the steps use but do not define, as source: those the
        definitions themselves use first (a function's source may need an import)."""
        pending = set().union(*(_names_used(s) for s in self.sources)) if self.sources else set()
        done: dict[str, str] = {}
        order: list[str] = []
        while pending:
            name = min(pending)  # in name order: the same script every time
            pending.discard(name)
            if name in done or name not in self.kernel or name == "dist":
                continue
            done[name] = _definition(name, self.kernel[name])
            order.append(name)
            pending |= _names_used(done[name]) - done.keys()

        # Imports, then plain values, then functions and classes (a default argument or a
        # class body may use a value), then what could not be written.
        def kind(text: str) -> int:
            if text.startswith(("import ", "from ")):
                return 0
            if text.startswith("#"):
                return 3
            return 2 if text.lstrip().startswith(("def ", "class ", "@", "async ")) else 1

        lines = sorted((done[name] for name in order), key=kind)
        return "\n".join(lines) + ("\n" if lines else "")


def _names_used(source: str) -> set[str]:
    """Names ``source`` reads and does not define itself (nor are builtins)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    used: set[str] = set()
    assigned: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else assigned).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            assigned.add(node.name)
        elif isinstance(node, ast.arg):
            assigned.add(node.arg)
        elif isinstance(node, ast.alias):
            assigned.add((node.asname or node.name).split(".")[0])
    return used - assigned - vars(builtins).keys()


def _definition(name: str, value: Any) -> str:
    if isinstance(value, types.ModuleType):
        module = value.__name__
        if module == name:
            return f"import {module}"
        if "." in module and module.rsplit(".", 1)[1] == name:
            parent, child = module.rsplit(".", 1)
            return f"from {parent} import {child}"
        return f"import {module} as {name}"
    if isinstance(value, (types.FunctionType, type)):
        module = getattr(value, "__module__", "__main__")
        own = getattr(value, "__name__", name)
        if module != "__main__":  # a library's: import it, under the notebook's name
            return f"from {module} import {own}" + (f" as {name}" if own != name else "")
        try:
            return textwrap.dedent(inspect.getsource(value))
        except (OSError, TypeError):
            pass
    literal = _literal(value, None)
    if literal is not None:
        return f"{name} = {literal}"
    return f"# {name} (a {type(value).__name__}) was defined in the notebook: define it here"


def _literal(value: Any, default: str | None) -> Any:
    """``repr(value)`` when it reads back as the same value; else ``default``."""
    text = repr(value)
    try:
        if ast.literal_eval(text) == value:
            return text
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    return default


def _show_last(source: str) -> str:
    """``source`` with its last expression wrapped in ``_show(...)`` (as the session showed it)."""
    source = textwrap.dedent(source).rstrip() + "\n"
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    if not tree.body or not isinstance(tree.body[-1], ast.Expr) or source.rstrip().endswith(";"):
        return source
    last = tree.body[-1]
    lines = source.splitlines(keepends=True)
    start, end = last.lineno - 1, (last.end_lineno or last.lineno)
    expression = "".join(lines[start:end]).strip()
    return "".join(lines[:start]) + f"_show({expression})\n" + "".join(lines[end:])
