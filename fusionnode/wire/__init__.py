"""The FusionNode wire protocol (protocol/SPEC.md): limits, tensor codecs, messages, frames, streams.

Importing this package registers the "raw" and "fp16" tensor codecs.
"""

from fusionnode.wire.codec_api import DTYPES, EncodedTensor, get_codec, register_codec, registered_codecs
from fusionnode.wire.frames import HEADER_LEN, PROTOCOL_MAJOR, PROTOCOL_MINOR
from fusionnode.wire.limits import DEFAULT_LIMITS, Limits
from fusionnode.wire.messages import (
    Call,
    Hello,
    Message,
    Reply,
    TensorMessage,
    decode_message,
    encode_message,
    frame_parts,
)
from fusionnode.wire.stream import read_message, write_message
from fusionnode.wire.tensors import decode_tensor, encode_tensor, pack_encoded, unpack_encoded

__all__ = [
    "DEFAULT_LIMITS",
    "DTYPES",
    "HEADER_LEN",
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "Call",
    "EncodedTensor",
    "Hello",
    "Limits",
    "Message",
    "Reply",
    "TensorMessage",
    "decode_message",
    "decode_tensor",
    "encode_message",
    "encode_tensor",
    "frame_parts",
    "get_codec",
    "pack_encoded",
    "read_message",
    "register_codec",
    "registered_codecs",
    "unpack_encoded",
    "write_message",
]
