"""AdaTopK: top-k compression of activations and gradients, its keep-ratio policy and error feedback.

Importing this package registers the "topk" codec with the wire codec registry.
"""

from fusionnode.compress.topk import TOPK, TopKCodec, keep_count, payload_bytes, topk_mask

__all__ = ["TOPK", "TopKCodec", "keep_count", "payload_bytes", "topk_mask"]
