"""Runs in a process that starts ranks: the kernel, or a cluster node's agent.

Written once for both: the process kinds a rank is started as (``_processes``: fork, spawn,
forkserver; signals, exit codes, reaping with a deadline) and what one run's ranks share where
they start (``_parts``: the rendezvous store, the scratch folder, the start gate, the
lifeline, a rank's pipes). Imports ``_shared``, and from ``_rank`` only what a process is
started with (``_spec``) and runs (``_entry``).
"""
