#!/usr/bin/env python3
"""Regenerate the golden vectors of protocol/COMPRESSION.md (deterministic): python protocol/vectors/generate_topk.py

Writes topk_<name>.json next to this file, in the format of generate.py:
  {"description": str, "kind": "tensor", "hex": pack_encoded bytes, "decoded": tensor JSON,
   "invalid": [{"description": str, "hex": bytes a receiver must reject with a protocol error}]}
The "invalid" entries are variants of the valid vector, each breaking one validation rule.
`--check` compares instead of writing.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import numpy as np
import torch

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parents[1]))

from fusionnode.compress.topk import TOPK  # noqa: E402  (registers "topk")
from fusionnode.wire.codec_api import EncodedTensor  # noqa: E402
from fusionnode.wire.vectors import (  # noqa: E402
    invalid_variant,
    render_vector,
    tensor_vector,
    write_or_check,
)


def _commoninvalid_variant(enc: EncodedTensor) -> list[dict[str, str]]:
    return [
        invalid_variant("payload truncated by one byte", enc, data=enc.data[:-1]),
        invalid_variant("one trailing byte after the values", enc, data=enc.data + b"\x00"),
        invalid_variant("k one more than the payload holds", enc, params={"k": enc.params["k"] + 1}),
        invalid_variant("ratio 0 (must be in (0, 1])", enc, params={"ratio": 0.0}),
        invalid_variant("ratio 1.5 (must be in (0, 1])", enc, params={"ratio": 1.5}),
        invalid_variant("unknown index encoding", enc, params={"index": "u24"}),
        invalid_variant("unknown value dtype", enc, params={"values": "float8"}),
        invalid_variant("unknown format version", enc, params={"v": 2}),
        invalid_variant("integer logical dtype", enc, dtype="int32"),
    ]


def build_vectors() -> dict[str, dict[str, Any]]:
    vectors: dict[str, dict[str, Any]] = {}

    # global, u8 index list: 40 elements, keep 3 (3 bytes of indices < 5 bytes of bitmap)
    x = torch.linspace(-0.5, 0.5, 40)
    x[1], x[5], x[38] = -3.0, 2.5, -4.0
    enc = TOPK.encode(x, ratio=0.075, value_dtype="float16")
    assert enc.params["index"] == "u8"
    idx = np.frombuffer(enc.data[:3], dtype="<u1").copy()
    dup = idx.copy()
    dup[1] = dup[0]
    unsorted = idx[[1, 0, 2]]
    oob = idx.copy()
    oob[2] = 40
    vectors["topk_global_u8"] = tensor_vector(
        "topk global, float32 [40], ratio 0.075 -> k=3, u8 flat indices [1, 5, 38], float16 values",
        enc,
        [
            *_commoninvalid_variant(enc),
            invalid_variant("duplicate index", enc, data=dup.tobytes() + enc.data[3:]),
            invalid_variant("indices not increasing", enc, data=unsorted.tobytes() + enc.data[3:]),
            invalid_variant("index 40 out of range for 40 elements", enc, data=oob.tobytes() + enc.data[3:]),
        ],
    )

    # global, u16 index list, bfloat16 values: 300 elements, keep 3 (1%)
    y = torch.zeros(300)
    y[7], y[256], y[299] = 1.0, -2.0, 3.5
    y[100] = 0.001
    enc = TOPK.encode(y, ratio=0.01, value_dtype="bfloat16")
    assert enc.params["index"] == "u16"
    vectors["topk_global_u16_bfloat16"] = tensor_vector(
        "topk global, float32 [300], ratio 0.01 -> k=3, u16 indices [7, 256, 299], bfloat16 values",
        enc,
        [
            invalid_variant(
                "index 300 out of range", enc, data=np.asarray([7, 256, 300], "<u2").tobytes() + enc.data[6:]
            ),
            invalid_variant(
                "u16 list declared as u8 (length no longer matches)", enc, params={"index": "u8"}
            ),
        ],
    )

    # global, bitmap: 10 elements, keep 5 (bitmap 2 bytes < 5 u8 indices)
    z = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0, -8.0, 9.0, -10.0], dtype=torch.float64)
    enc = TOPK.encode(z, ratio=0.5, value_dtype="float16")
    assert enc.params["index"] == "bitmap"
    bitmap = bytearray(enc.data[:2])
    pad = bytearray(bitmap)
    pad[1] |= 0x80  # bit 15: past element 9
    fewer = bytearray(bitmap)
    fewer[1] &= 0xFD  # clear bit 9 (element 9 is kept): popcount 4 != k
    vectors["topk_global_bitmap_float64"] = tensor_vector(
        "topk global, float64 [10], ratio 0.5 -> k=5, bitmap (LSB first) of elements 5..9, float16 values",
        enc,
        [
            invalid_variant("bitmap bit set past the last element", enc, data=bytes(pad) + enc.data[2:]),
            invalid_variant("bitmap popcount 4 != k 5", enc, data=bytes(fewer) + enc.data[2:]),
        ],
    )

    # row mode, u8 within-row indices: [2, 3, 32], keep 2 per row (12 bytes of indices < 24 of bitmap)
    r = torch.zeros(2, 3, 32)
    r[0, 0, [1, 3, 7]] = torch.tensor([-0.9, 0.8, 0.4])
    r[0, 1, [0, 31]] = torch.tensor([1.0, -1.5])
    r[0, 2, [1, 3]] = torch.tensor([2.0, 3.0])
    r[1, 0, [0, 1, 2]] = torch.tensor([0.5, 0.5, -0.5])  # a three-way tie: indices 0 and 1 are kept
    r[1, 1, [6, 7]] = torch.tensor([7.0, 6.0])
    r[1, 2, [0, 30]] = torch.tensor([-1.0, 1.25])
    enc = TOPK.encode(r, ratio=0.0625, mode="row", value_dtype="float16")
    assert enc.params["index"] == "u8" and enc.params["k"] == 12
    ridx = np.frombuffer(enc.data[:12], dtype="<u1").copy()
    dup_row = ridx.copy()
    dup_row[3] = dup_row[2]
    out_row = ridx.copy()
    out_row[1] = 32
    vectors["topk_row_u8"] = tensor_vector(
        "topk row (per token), float32 [2, 3, 32], ratio 0.0625 -> k_row=2, k=12, u8 within-row indices; "
        "ties keep the lower index",
        enc,
        [
            invalid_variant("duplicate index within a row", enc, data=dup_row.tobytes() + enc.data[12:]),
            invalid_variant(
                "row index 32 out of range for rows of 32", enc, data=out_row.tobytes() + enc.data[12:]
            ),
            invalid_variant(
                "k not a multiple of the 6 rows", enc, params={"k": 11}, data=enc.data[:11] + enc.data[12:34]
            ),
            invalid_variant("row_len != shape[-1]", enc, params={"row_len": 16}),
        ],
    )

    # centered row mode: channel means first, then the top-k of the centered tensor
    c = torch.zeros(3, 8)
    c[:, 0] = torch.tensor([10.0, 12.0, 11.0])
    c[:, 2] = -1.0
    c[2, 1] = 4.0
    c[0, 5] = 0.5
    enc = TOPK.encode(c, ratio=0.125, mode="row", value_dtype="float16", center=True)
    assert enc.params["index"] == "u8" and enc.params["k"] == 3
    vectors["topk_row_centered"] = tensor_vector(
        "topk row, centered, float32 [3, 8], ratio 0.125 -> 8 float16 channel means, then k_row=1 "
        "u8 index per row and a float16 value of (x - mean); dropped elements decode to their channel mean",
        enc,
        [
            invalid_variant("center section missing (payload 16 bytes short)", enc, data=enc.data[16:]),
            invalid_variant("center 2 (must be 0 or 1)", enc, params={"center": 2}),
        ],
    )

    # empty tensor
    enc = TOPK.encode(torch.zeros(0, 4), ratio=0.1, mode="row")
    vectors["topk_empty"] = tensor_vector(
        "topk row, float32 [0, 4]: k=0, empty payload",
        enc,
        [invalid_variant("k=1 for an empty tensor", enc, params={"k": 1})],
    )
    return vectors


render = render_vector


def main(argv: list[str] | None = None) -> int:
    return write_or_check(build_vectors, HERE, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
