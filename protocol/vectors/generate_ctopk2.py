#!/usr/bin/env python3
"""Regenerate the golden vectors of the ctopk2 codec (protocol/COMPRESSION.md): python protocol/vectors/generate_ctopk2.py

Writes ctopk2_<name>.json next to this file, in the format of generate_topk.py:
  {"description": str, "kind": "tensor", "hex": pack_encoded bytes, "decoded": tensor JSON,
   "invalid": [{"description": str, "hex": bytes a receiver must reject with a protocol error}]}
Each "invalid" entry is a variant of the valid vector breaking one validation rule.
`--check` compares instead of writing.
"""

from __future__ import annotations

import dataclasses
import pathlib
import struct
import sys
from typing import Any

import torch

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parents[1]))

from fusionnode.compress.pseudograd import CTOPK2  # noqa: E402  (registers "ctopk2")
from fusionnode.wire import pack_encoded  # noqa: E402
from fusionnode.wire.vectors import (  # noqa: E402
    invalid_variant,
    render_vector,
    replace_bytes,
    tensor_vector,
    write_or_check,
)


def build_vectors() -> dict[str, dict[str, Any]]:
    vectors: dict[str, dict[str, Any]] = {}

    # float32 [2, 5], chunk 4, k 2: chunks [0.5 -4 0.1 2] [0 -1 3 0.2] and a tail [-0.3 0.05]
    x = torch.tensor([[0.5, -4.0, 0.1, 2.0, 0.0], [-1.0, 3.0, 0.2, -0.3, 0.05]])
    enc = CTOPK2.encode(x, chunk=4, k=2)
    data = bytes(enc.data)
    without_k = dict(enc.params)
    del without_k["k"]
    # layout: 3 chunks x (lo, hi) float32 = 24 bytes, 6 u8 indices, 2 bytes of 2-bit codes
    vectors["ctopk2_tail"] = tensor_vector(
        "ctopk2, float32 [2, 5], chunk 4, k 2: scales (2, 4) (1, 3) (0.05, 0.3), indices 1 3 | 1 2 | 0 1, "
        "codes sign|level<<1 packed four per byte; the short last chunk keeps min(k, 2)",
        enc,
        [
            invalid_variant("payload truncated by one byte", enc, data=data[:-1]),
            invalid_variant("one trailing byte", enc, data=data + b"\x00"),
            invalid_variant("index equal to the chunk length", enc, data=replace_bytes(data, 25, b"\x04")),
            invalid_variant("index past the short last chunk", enc, data=replace_bytes(data, 29, b"\x02")),
            invalid_variant("indices not increasing in a chunk", enc, data=replace_bytes(data, 24, b"\x03")),
            invalid_variant("lo above hi", enc, data=replace_bytes(data, 0, struct.pack("<f", 5.0))),
            invalid_variant("negative lo", enc, data=replace_bytes(data, 8, struct.pack("<f", -1.0))),
            invalid_variant("NaN scale", enc, data=replace_bytes(data, 4, struct.pack("<f", float("nan")))),
            invalid_variant("padding bits set", enc, data=data[:-1] + bytes([data[-1] | 0x80])),
            invalid_variant("k above chunk", enc, params={"k": 5}),
            invalid_variant("k zero", enc, params={"k": 0}),
            invalid_variant("chunk zero", enc, params={"chunk": 0}),
            invalid_variant("chunk above 65536", enc, params={"chunk": 65537}),
            invalid_variant("unknown index encoding", enc, params={"index": "u32"}),
            invalid_variant("unknown format version", enc, params={"v": 2}),
            invalid_variant("unknown extra param", enc, params={"density": 0.5}),
            {
                "description": "missing param k",
                "hex": pack_encoded(dataclasses.replace(enc, params=without_k)).hex(),
            },
            invalid_variant("integer logical dtype", enc, dtype="int32"),
        ],
    )

    # bfloat16 [600], chunk 300 (u16 indices), k 3, with a tie at the threshold (lower index wins)
    y = torch.zeros(600, dtype=torch.bfloat16)
    y[[5, 17, 299]] = torch.tensor([1.0, -1.0, 0.5], dtype=torch.bfloat16)
    y[[300, 301, 450, 599]] = torch.tensor([-2.0, 0.25, 0.25, 0.25], dtype=torch.bfloat16)
    enc = CTOPK2.encode(y, chunk=300, k=3)
    vectors["ctopk2_u16_bfloat16"] = tensor_vector(
        "ctopk2, bfloat16 [600], chunk 300 (u16 indices), k 3: chunk 1 keeps -2 and the first two of "
        "three tied 0.25 (positions 0, 1, 150)",
        enc,
        [
            invalid_variant("u8 indices for a chunk of 300", enc, params={"index": "u8"}),
            invalid_variant("payload truncated by one byte", enc, data=bytes(enc.data)[:-1]),
        ],
    )

    # empty tensor: no chunks, no payload
    enc = CTOPK2.encode(torch.zeros(0, 3), chunk=16, k=4)
    vectors["ctopk2_empty"] = tensor_vector(
        "ctopk2, float32 [0, 3]: no chunks, empty payload",
        enc,
        [invalid_variant("one byte for an empty tensor", enc, data=b"\x00")],
    )
    return vectors


render = render_vector


def main(argv: list[str] | None = None) -> int:
    return write_or_check(build_vectors, HERE, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
