"""Live ranks, kernel side: ranks kept between cells (``Ranks``, ``%%ranks``, export).

Built on ``_kernel`` (the same checks, start and supervision as a launch); a rank serves the
tasks with ``_rank/_serve.py``.
"""
