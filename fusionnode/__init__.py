"""FusionNode: a peer-to-peer daemon for decentralized LLM training."""

__version__ = "0.1.0"
