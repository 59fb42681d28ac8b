"""AdaTopK: top-k compression of activations and gradients, its keep-ratio policy and error feedback.

Importing this package registers the "topk", "q8" and "q4" codecs with the wire codec registry.
"""

from fusionnode.compress.boundary import CompressionBoundary, LinkCounters, transmit
from fusionnode.compress.feedback import ErrorFeedback
from fusionnode.compress.link import LinkCompressor, LinkOptions, adatopk_config
from fusionnode.compress.policy import AdaTopKPolicy, CompressSpec, parse_compress
from fusionnode.compress.quant import Q4, Q8, QuantCodec, quant_payload_bytes
from fusionnode.compress.topk import TOPK, TopKCodec, keep_count, payload_bytes, topk_mask

__all__ = [
    "Q4",
    "Q8",
    "TOPK",
    "AdaTopKPolicy",
    "CompressSpec",
    "CompressionBoundary",
    "ErrorFeedback",
    "LinkCompressor",
    "LinkCounters",
    "LinkOptions",
    "QuantCodec",
    "TopKCodec",
    "adatopk_config",
    "keep_count",
    "parse_compress",
    "payload_bytes",
    "quant_payload_bytes",
    "topk_mask",
    "transmit",
]
