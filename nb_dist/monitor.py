"""TEMPORARY: the monitor moved to nb_dist.views.monitor; delete once launcher.py imports it."""
from .views.monitor import LaunchMonitor, kernel_frontend_possible  # noqa: F401
