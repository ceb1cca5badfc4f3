"""Code that runs in the kernel (or the script) that launches: the launch from call to result.

Checks and the plan (``_preflight``, ``_plan``, ``_openmp``, ``_ports``), where the ranks run
(``_transport``, ``_local``, ``_attempt_setup``; they start through ``_starter``), watching them
(``_supervisor``, ``_rank_handle``, ``_output``, ``_prompts``, ``_monitor``), explaining
failures (``_diagnosis``, ``_tracebacks``, ``_errors``), and the result (``_result``,
``_warm``). It imports ``_shared``, ``_starter``, and ``_rank`` only for what a process is
started with (``_spec``, ``_as_main``).
"""
