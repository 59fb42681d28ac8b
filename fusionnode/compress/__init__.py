"""AdaTopK: top-k compression of activations and gradients, its keep-ratio policy and error feedback.

Importing this package registers the "topk" codec with the wire codec registry.
"""

from fusionnode.compress.boundary import BoundaryConfig, CompressionBoundary, LinkCounters, transmit
from fusionnode.compress.feedback import ErrorFeedback
from fusionnode.compress.policy import AdaTopKPolicy, CompressSpec, parse_compress
from fusionnode.compress.topk import TOPK, TopKCodec, keep_count, payload_bytes, topk_mask

__all__ = [
    "TOPK",
    "AdaTopKPolicy",
    "BoundaryConfig",
    "CompressSpec",
    "CompressionBoundary",
    "ErrorFeedback",
    "LinkCounters",
    "TopKCodec",
    "keep_count",
    "parse_compress",
    "payload_bytes",
    "topk_mask",
    "transmit",
]
