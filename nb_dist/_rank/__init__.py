"""Code that runs inside a rank's process, from its start to ``os._exit``.

Its entry point (``_entry``), the one-shot function run (``_oneshot``), a live rank's task
loop (``_serve``), pdb over the rank's pipes (``_debug``), torch's rendezvous and process
groups hooked (``_rendezvous``, ``_groups``), and the spec the kernel hands it (``_spec``).
Imports only ``_shared``: a rank never loads the kernel's machinery.
"""
