"""`fusionnode bench wire`'s codec section: the wire codec's encode and decode paths against a plain copy.

Method. For each size (MiB of float32), build one tensor and time, best of REPEATS runs:
`memcpy`  one copy of the payload into a new buffer (numpy `copy`, the reference);
`enc_t`   encode_tensor(raw): one copy; `dec_t` decode_tensor of an immutable payload: one copy;
`enc_msg` encode_tensor + encode_message -> bytes (two copies);
`dec_msg` decode_message(bytes) + decode_tensor (one copy: a bytes frame is immutable memory);
`send`    encode_tensor + frame_parts, the buffers write_message hands to the transport (one copy);
`recv`    decode_message(writable frame) + decode_tensor, as after read_message (zero-copy).
Each figure is for steady state: one operation repeated, so the allocator can reuse freed memory.
`enc_msg` keeps two big buffers alive at once and, with glibc, pays fresh page faults on every
run (the freed pair goes back to the OS), which is why it trails `send`.
Ratios are memcpy time / codec time: 1.0 means as fast as one plain copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from fusionnode.wire import (
    TensorMessage,
    decode_message,
    decode_tensor,
    encode_message,
    encode_tensor,
    frame_parts,
)
from fusionnode.wire.limits import Limits

SIZES_MIB = (1, 4, 16, 64)  # tensor payload sizes of the codec benchmark
QUICK_SIZES_MIB = (1, 4, 16)
REPEATS = 7  # timed runs per codec measurement (best of)
QUICK_REPEATS = 3
MIB = 1 << 20


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Fastest of `repeats` timed runs after one warm-up: on a shared machine the minimum is the cost of
    the code itself, the rest is other processes' noise (the timeit convention)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_codec(sizes_mib: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    rows = []
    limits = Limits(max_frame_bytes=max(sizes_mib) * MIB + MIB, max_tensor_elements=max(sizes_mib) * MIB // 4)
    for mib in sizes_mib:
        t = torch.randn(mib * MIB // 4, generator=torch.Generator().manual_seed(0))
        src = t.numpy()
        frame = encode_message(TensorMessage.from_tensors("activation", {"step": 0}, {"x": t}), limits=limits)
        frame_rw = bytearray(frame)
        enc = encode_tensor(t)

        def message(t: torch.Tensor = t) -> TensorMessage:
            return TensorMessage("activation", {"step": 0}, {"x": encode_tensor(t)})

        def decode(buf: bytes | bytearray) -> torch.Tensor:
            return decode_tensor(decode_message(buf, limits).tensors["x"], limits)

        if not (torch.equal(decode(frame), t) and torch.equal(decode(frame_rw), t)):
            raise RuntimeError("wire round trip changed the tensor")
        s_copy = best_seconds(lambda src=src: src.copy(), repeats)
        s_tenc = best_seconds(lambda t=t: encode_tensor(t), repeats)
        s_tdec = best_seconds(lambda enc=enc: decode_tensor(enc), repeats)
        s_enc = best_seconds(lambda: encode_message(message(), limits=limits), repeats)
        s_dec = best_seconds(lambda frame=frame: decode(frame), repeats)
        s_send = best_seconds(lambda: frame_parts(message(), limits=limits), repeats)
        s_recv = best_seconds(lambda frame_rw=frame_rw: decode(frame_rw), repeats)
        rows.append(
            {
                "size_mib": mib,
                "memcpy_mib_s": mib / s_copy,
                "encode_tensor_mib_s": mib / s_tenc,
                "decode_tensor_mib_s": mib / s_tdec,
                "encode_tensor_ratio": s_copy / s_tenc,
                "decode_tensor_ratio": s_copy / s_tdec,
                "encode_message_mib_s": mib / s_enc,
                "decode_message_mib_s": mib / s_dec,
                "message_ratio": s_copy / (s_enc + s_dec),
                "send_mib_s": mib / s_send,
                "recv_mib_s": mib / s_recv,
                "stream_ratio": s_copy / (s_send + s_recv),
            }
        )
    return rows


def print_codec(codec_rows: list[dict[str, Any]]) -> None:
    print("wire codec, one float32 tensor: MiB/s, best of runs; ratio = memcpy time / our time")
    print(
        f"{'size':>6} {'memcpy':>7} | {'enc_t':>7} {'ratio':>5} {'dec_t':>7} {'ratio':>5} |"
        f" {'enc_msg':>7} {'dec_msg':>7} {'ratio':>5} | {'send':>7} {'recv':>7} {'ratio':>5}"
    )
    for r in codec_rows:
        print(
            f"{r['size_mib']:>4}Mi {r['memcpy_mib_s']:>7.0f} | {r['encode_tensor_mib_s']:>7.0f}"
            f" {r['encode_tensor_ratio']:>5.2f} {r['decode_tensor_mib_s']:>7.0f} {r['decode_tensor_ratio']:>5.2f} |"
            f" {r['encode_message_mib_s']:>7.0f} {r['decode_message_mib_s']:>7.0f} {r['message_ratio']:>5.2f} |"
            f" {r['send_mib_s']:>7.0f} {r['recv_mib_s']:>7.0f} {r['stream_ratio']:>5.2f}"
        )
    print("  enc_t/dec_t: encode_tensor / decode_tensor of an immutable payload (one copy each)")
    print("  enc_msg/dec_msg: encode_tensor+encode_message -> bytes / decode_message(bytes)+decode_tensor")
    print("  send/recv: encode_tensor+frame_parts as write_message sends it / decode of the writable frame")
    print("  read_message yields (zero-copy); the pair ratios use the sum of both times")
