"""Dashboard and Prometheus metrics endpoint of a node."""

from fusionnode.web.server import Dashboard, StatusCollector

__all__ = ["Dashboard", "StatusCollector"]
