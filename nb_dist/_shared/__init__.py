"""Code both sides run: the rank and the kernel import it (the bottom layer).

The messages on a rank's control pipe and the environment names both sides read
(``_protocol``), reports and progress (``_reporting``), the collective counter
(``_collectives``), functions shipped by value (``_shipping``), the mixed-precision helpers
(``_precision``), which frames are nb_dist's (``_frames``), which imports a rank names for
warm relaunches (``_imports``) and where this process first touched CUDA
(``_cuda_touches``). Nothing here imports from the other subpackages.
"""
