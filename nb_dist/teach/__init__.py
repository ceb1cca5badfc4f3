"""Exercises for the teaching notebooks: runs in the kernel, beside the notebook's own code.

A notebook asks a question in a cell that sets ``answer`` (or defines a function for the
student to write), and checks it in the next cell with :func:`check` or :func:`check_code`.
The solutions edition (``notebooks/``) carries the answers; the student edition
(``notebooks/student/``) is made from it by ``nb-dist student-edition``, with every answer
replaced by ``...``. A check on a ``...`` says "not answered yet" and lets Run All go on.
An explanation that gives an answer away waits, in the student edition, for that exercise's
check to say "right": :func:`explain`.
``torch_versions`` gives torch 2.13's names of a few distributed APIs on older torch.
``instruments`` holds the notebooks' measuring tools: ``CollectiveLog`` (every collective a rank
runs, with its bytes) and ``GraphRecorder`` (what each graph ``torch.compile`` captured takes).
"""

from __future__ import annotations

from .exercises import NOT_ANSWERED as NOT_ANSWERED
from .exercises import WrongAnswer, answered, check, check_code, explain
from .torch_versions import all_gather_single, ddp_buffer_sync, reduce_scatter_single, torch_name

# NOT_ANSWERED (the text a check prints for a blank) is importable, not exported.
__all__ = [
    "WrongAnswer",
    "all_gather_single",
    "answered",
    "check",
    "check_code",
    "ddp_buffer_sync",
    "explain",
    "reduce_scatter_single",
    "torch_name",
]
