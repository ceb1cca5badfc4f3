"""Runs in the node agent: one Ray actor per cluster node that starts that node's ranks.

The agent starts its ranks with nb_dist's own machinery (spawn or forkserver ranks, their
pipes, the start gate, the lifeline), reads their pipes and collective counters on the node,
and hands the raw bytes to the kernel (``nb_dist._cluster``), which feeds them to the same
code that reads local ranks. Imports ``_shared``, ``_starter`` (the same process kinds, store,
gate and lifeline as the kernel's), and from ``_rank`` what a rank is started with; never the
kernel.
"""
