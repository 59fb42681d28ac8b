"""Dashboard and Prometheus metrics endpoint of a node."""

from fusionnode.web.metrics import StatusCollector
from fusionnode.web.server import Dashboard

__all__ = ["Dashboard", "StatusCollector"]
