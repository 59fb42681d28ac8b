"""One exception root for FusionNode; subclasses also inherit the builtin they refine."""

from __future__ import annotations


class FusionNodeError(Exception):
    """Root of every error FusionNode raises on purpose."""


class ProtocolError(FusionNodeError, ValueError):
    """A frame or message that violates protocol/SPEC.md (malformed, truncated, over a limit)."""


class VersionMismatchError(ProtocolError):
    """The peer speaks another major version of the wire protocol."""


class ConfigError(FusionNodeError, ValueError):
    """Bad user input: a flag, a cluster file, a model name."""


class GraphError(FusionNodeError, ValueError):
    """A model that cannot be traced or described portably; names the offending op."""


class PlanError(FusionNodeError, ValueError):
    """No plan fits the devices (memory, bandwidth); says what would fit."""


class PeerError(FusionNodeError, ConnectionError):
    """A remote peer failed, refused, or answered with something invalid."""


class DeadlineError(PeerError, TimeoutError):
    """A wait ran past its deadline."""


class DaemonError(FusionNodeError, RuntimeError):
    """The local daemon is not running, not reachable, or failed to start."""


class JobCancelled(FusionNodeError, RuntimeError):
    """A job was cancelled on purpose (`fusionnode cancel`, or the dashboard's cancel button)."""
