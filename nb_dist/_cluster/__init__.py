"""Kernel side of a launch on a cluster: runs in the kernel, ranks on other machines.

``nb_dist.RayCluster`` reserves one placement-group bundle per node, puts a node agent
(``nb_dist._node``) in each, and for every launch forwards the agents' raw pipe bytes into
local pipes, so the kernel's supervisor, output, diagnosis and results (``_kernel``) read a
remote rank exactly as a local one. Imports ``_kernel``, ``_shared`` and ``_rank._spec``;
``ray`` only when a cluster is made, never at ``import nb_dist``.
"""
