# TEMPORARY re-export: the monitor is nb_dist.views.monitor; delete once launcher.py imports that.
from .views.monitor import LaunchMonitor, kernel_frontend_possible  # noqa: F401
