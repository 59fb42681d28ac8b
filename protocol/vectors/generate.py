#!/usr/bin/env python3
"""Regenerate the golden vectors of protocol/SPEC.md (deterministic): python protocol/vectors/generate.py

Writes one <name>.json per vector next to this file:
  {"description": str, "kind": "message" | "tensor", "hex": encoded bytes, "decoded": JSON meaning}
The JSON meaning is defined in fusionnode/wire/vectors.py. topk_*.json files belong to
fusionnode/compress and are not touched here. `--check` compares instead of writing.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import torch

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parents[1]))

from fusionnode.wire import Call, Hello, Reply, TensorMessage, encode_message, encode_tensor, pack_encoded  # noqa: E402
from fusionnode.wire.vectors import message_json, render_vector, tensor_json, write_or_check  # noqa: E402


def _tensor(description: str, t: torch.Tensor, codec: str = "raw") -> dict[str, Any]:
    enc = encode_tensor(t, codec)
    return {
        "description": description,
        "kind": "tensor",
        "hex": pack_encoded(enc).hex(),
        "decoded": tensor_json(enc),
    }


def _message(description: str, msg: Any, checksum: bool = False) -> dict[str, Any]:
    frame = encode_message(msg, checksum=checksum)
    return {"description": description, "kind": "message", "hex": frame.hex(), "decoded": message_json(msg)}


def _committed(msg: Any) -> Any:
    from fusionnode.verify.commitment import DIGEST_KEY, digest_encoded

    msg.meta[DIGEST_KEY] = digest_encoded(msg.tensors)
    return msg


def build_vectors() -> dict[str, dict[str, Any]]:
    f32 = torch.tensor([[0.0, 1.5, -2.25], [1e-3, 3.0e30, -7.0]], dtype=torch.float32)
    activation = torch.tensor([[0.5, -1.0, 2.0], [0.1, 70000.0, -3.0e-6]], dtype=torch.float32)
    return {
        "tensor_raw_float32": _tensor("raw float32, shape [2, 3]", f32),
        "tensor_raw_float64": _tensor(
            "raw float64, shape [3]", torch.tensor([1.0 / 3.0, -1e-300, 2.0**60], dtype=torch.float64)
        ),
        "tensor_raw_bfloat16": _tensor(
            "raw bfloat16, shape [2, 2]: two bytes per element, the upper half of float32",
            torch.tensor([[1.0, -2.5], [3.0e20, 0.0078125]], dtype=torch.bfloat16),
        ),
        "tensor_raw_float16": _tensor(
            "raw float16, shape [4]",
            torch.tensor([1.0, -0.0999755859375, 65504.0, 6.103515625e-05], dtype=torch.float16),
        ),
        "tensor_raw_int64": _tensor(
            "raw int64, shape [3]", torch.tensor([-1, 2**40, -(2**63)], dtype=torch.int64)
        ),
        "tensor_raw_int32": _tensor(
            "raw int32, shape [2, 2]", torch.tensor([[1, -2], [2**31 - 1, 0]], dtype=torch.int32)
        ),
        "tensor_raw_int16": _tensor(
            "raw int16, shape [3]", torch.tensor([-32768, 1, 32767], dtype=torch.int16)
        ),
        "tensor_raw_int8": _tensor("raw int8, shape [4]", torch.tensor([-128, -1, 0, 127], dtype=torch.int8)),
        "tensor_raw_uint8": _tensor(
            "raw uint8, shape [2, 2]", torch.tensor([[0, 1], [128, 255]], dtype=torch.uint8)
        ),
        "tensor_raw_bool": _tensor(
            "raw bool, shape [5]: one byte per element, 0 or 1",
            torch.tensor([True, False, False, True, True]),
        ),
        "tensor_raw_empty": _tensor(
            "raw float32 with zero elements, shape [0, 3]: empty payload", torch.zeros(0, 3)
        ),
        "tensor_raw_scalar": _tensor("raw 0-d float32 tensor (shape []): one element", torch.tensor(-4.75)),
        "tensor_fp16_float32": _tensor(
            "fp16 codec, logical float32 shape [2, 3]: rounded to nearest float16, 70000 saturates to 65504",
            activation,
            codec="fp16",
        ),
        "tensor_fp16_bfloat16": _tensor(
            "fp16 codec, logical bfloat16 shape [3]",
            torch.tensor([1.0, -0.5, 3.140625], dtype=torch.bfloat16),
            codec="fp16",
        ),
        "message_hello": _message(
            "Hello (type 1)",
            Hello(peer_id="12D3KooWExamplePeer", software="fusionnode/0.1.0", protocol=(1, 0)),
        ),
        "message_call": _message(
            "Call (type 2) with every msgpack value kind in args",
            Call(
                method="ping",
                args={
                    "n": 7,
                    "neg": -300,
                    "big": 2**40,
                    "x": 0.25,
                    "flag": True,
                    "none": None,
                    "name": "stage-1",
                    "blob": b"\x00\x01\xff",
                    "list": [1, "two", [3.5]],
                    "map": {"a": {"b": False}},
                },
            ),
        ),
        "message_reply_ok": _message(
            "Reply (type 3) with a result", Reply(ok=True, result={"pong": 1, "t": 1.5})
        ),
        "message_reply_error": _message(
            "Reply (type 3) with an error: the job protocol's code and the peer to blame in result (13.3)",
            Reply(
                ok=False,
                result={"code": "bad_tensor", "blame": "12D3KooWExamplePeer"},
                error="JobError: peer 12D3KooWExam… sent non-finite values in 'h' ('act')",
            ),
        ),
        "message_tensors": _message(
            "TensorMessage (type 4): an activation with two tensors (raw, fp16); payloads 8-byte aligned",
            TensorMessage(
                kind="activation",
                meta={"job": "job-1", "step": 3, "micro_batch": 1, "stage": 0, "plan_version": 2},
                tensors={
                    "hidden": encode_tensor(f32, "raw"),
                    "mask": encode_tensor(torch.tensor([[True, False, True]]), "raw"),
                    "act": encode_tensor(activation, "fp16"),
                },
            ),
        ),
        "message_tensors_crc": _message(
            "TensorMessage with the CRC-32 flag (bit 0) set",
            TensorMessage(
                kind="gradient",
                meta={"job": "job-1", "step": 3},
                tensors={"g": encode_tensor(torch.tensor([0.5, -0.25], dtype=torch.float64))},
            ),
            checksum=True,
        ),
        "message_act_commitment": _message(
            "TensorMessage `act` of a checked job (SPEC.md 5.4): meta.digest is the sender's commitment, "
            "'b3:' + the hex BLAKE3-128 of its tensors in name order (fusionnode/verify/commitment.py)",
            _committed(
                TensorMessage(
                    kind="act",
                    meta={"job": "job-1", "step": 3, "mb": 1, "stage": 1},
                    tensors={"h": encode_tensor(activation, "raw"), "pos": encode_tensor(torch.arange(3))},
                )
            ),
        ),
        "message_tensors_empty": _message(
            "TensorMessage with no tensors: the body is the envelope alone",
            TensorMessage(kind="params", meta={"names": []}, tensors={}),
        ),
    }


render = render_vector


def main(argv: list[str] | None = None) -> int:
    return write_or_check(build_vectors, HERE, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
