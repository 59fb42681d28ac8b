#!/usr/bin/env python3
"""Regenerate the golden vectors of the q8/q4 codecs (protocol/COMPRESSION.md): python protocol/vectors/generate_q8.py

Writes q8_<name>.json next to this file (q4 vectors are named q8_q4_*), in the format of generate_topk.py:
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

from fusionnode.compress.dither import dither_seed  # noqa: E402
from fusionnode.compress.quant import Q4, Q8  # noqa: E402  (registers "q8" and "q4")
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

    # q8, float32 [3, 4], round to nearest, float32 scales (12 bytes) then 12 int8 values
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [-2.0, 1.0, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    enc = Q8.encode(x)
    data = bytes(enc.data)
    without_scale = dict(enc.params)
    del without_scale["scale"]
    vectors["q8_rows"] = tensor_vector(
        "q8, float32 [3, 4], nearest rounding: float32 scales [1/127, 2/127, 0] then int8 values "
        "(row 0: 127 -64 32 0); an all-zero row has scale 0",
        enc,
        [
            invalid_variant("payload truncated by one byte", enc, data=data[:-1]),
            invalid_variant("one trailing byte", enc, data=data + b"\x00"),
            invalid_variant("value -128 (outside [-127, 127])", enc, data=replace_bytes(data, 12, b"\x80")),
            invalid_variant("negative scale", enc, data=replace_bytes(data, 0, struct.pack("<f", -1.0))),
            invalid_variant("NaN scale", enc, data=replace_bytes(data, 4, struct.pack("<f", float("nan")))),
            invalid_variant(
                "infinite scale", enc, data=replace_bytes(data, 8, struct.pack("<f", float("inf")))
            ),
            invalid_variant("row_len != shape[-1]", enc, params={"row_len": 3}),
            invalid_variant("unknown scale dtype", enc, params={"scale": "float64"}),
            invalid_variant("unknown format version", enc, params={"v": 2}),
            invalid_variant("unknown extra param", enc, params={"seed": 1}),
            {
                "description": "missing param scale",
                "hex": pack_encoded(dataclasses.replace(enc, params=without_scale)).hex(),
            },
            invalid_variant("integer logical dtype", enc, dtype="int32"),
            invalid_variant(
                "scale declared float16 (length no longer matches)", enc, params={"scale": "float16"}
            ),
        ],
    )

    # q8, bfloat16 [2, 3] with float16 scales (4 bytes) then 6 int8 values
    y = torch.tensor([[0.5, -0.25, 0.125], [3.0, 1.5, -3.0]], dtype=torch.bfloat16)
    enc = Q8.encode(y, scale_dtype="float16")
    vectors["q8_float16_scales_bfloat16"] = tensor_vector(
        "q8, bfloat16 [2, 3], float16 scales (per row absmax / 127), nearest rounding",
        enc,
        [invalid_variant("payload truncated by one byte", enc, data=bytes(enc.data)[:-1])],
    )

    # q8 scalar: one row of one element
    enc = Q8.encode(torch.tensor(-0.75, dtype=torch.float64))
    vectors["q8_scalar"] = tensor_vector(
        "q8, float64 scalar []: row_len 1, one float32 scale 0.75/127, value -127",
        enc,
        [invalid_variant("row_len 0 for a scalar", enc, params={"row_len": 0})],
    )

    # empty tensor: no rows, no payload
    enc = Q8.encode(torch.zeros(0, 4))
    vectors["q8_empty"] = tensor_vector(
        "q8, float32 [0, 4]: no rows, empty payload",
        enc,
        [invalid_variant("one byte for an empty tensor", enc, data=b"\x00")],
    )

    # q4, odd element count: two nibbles per byte, low nibble first, a zero padding nibble
    z = torch.tensor([[0.7, -0.35, 0.1], [0.0, 1.4, -0.7], [-0.05, 0.05, 0.0]])
    enc = Q4.encode(z)
    data = bytes(enc.data)
    last = data[-1]
    vectors["q8_q4_odd"] = tensor_vector(
        "q4, float32 [3, 3], nearest rounding: float32 scales (absmax / 7), then 9 signed 4-bit values "
        "(two's complement nibbles, low nibble first) in 5 bytes; the last high nibble is zero padding",
        enc,
        [
            invalid_variant("payload truncated by one byte", enc, data=data[:-1]),
            invalid_variant(
                "nibble 0x8 (-8, outside [-7, 7])",
                enc,
                data=replace_bytes(data, 12, bytes([0x08 | (data[12] & 0xF0)])),
            ),
            invalid_variant("padding nibble not zero", enc, data=data[:-1] + bytes([last | 0x10])),
            invalid_variant("q4 payload declared as q8", enc, codec="q8"),
        ],
    )
    # q8 with the keyed dither of a link (compress/dither.py): the seed derived from the message, then
    # torch's CPU generator's uniforms (one block of rows, reused per 65536-element chunk)
    ctx = {"job": "job-7f3a", "stage": 3, "step": 12, "mb": 1, "key": "grad", "name": "x"}
    seed = dither_seed(**ctx)
    w = torch.tensor([[0.3, -0.71, 0.05, 0.9], [-1.2, 0.44, 0.61, -0.02]])
    enc = Q8.encode(w, seed=seed)
    vectors["q8_keyed_dither"] = {
        **tensor_vector(
            f"q8, float32 [2, 4], stochastic rounding with the keyed dither of job 'job-7f3a', stage 3, "
            f"step 12, micro-batch 1, key 'grad', tensor 'x': seed {seed:#x} (the first 8 bytes of "
            "SHA-256 of 'fusionnode-q-dither/1', job, stage, step, mb, key, name joined by NUL bytes, "
            "little-endian, shifted right by 1), uniforms from torch.Generator().manual_seed(seed)",
            enc,
            [invalid_variant("payload truncated by one byte", enc, data=bytes(enc.data)[:-1])],
        ),
        "dither": {**ctx, "seed": seed},
    }
    return vectors


render = render_vector


def main(argv: list[str] | None = None) -> int:
    return write_or_check(build_vectors, HERE, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
