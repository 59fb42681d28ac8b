"""Throughput of the "topk" codec: compress + decompress, in MB/s of dense float32 input.

Method: for each size (MiB of float32) and keep ratio, a seeded standard-normal tensor is
encoded and decoded `--repeat` times on ONE torch thread; the best wall time of the
round trip is reported as MB/s of dense input (1 MB = 1e6 bytes), next to the line rate
of a 1 Gbit/s link (125 MB/s): a codec faster than that is not the bottleneck of such a
link. The byte ratio is dense bytes / payload bytes. Packing into a frame is excluded
(the wire layer's cost, the same for every codec).

Run: python -m fusionnode.bench.codec [--sizes 1,4,16,64] [--ratios 0.01,0.1,0.5] [--mode global|row]
"""

from __future__ import annotations

import argparse
import time

import torch

from fusionnode.compress.topk import TOPK

DEFAULT_SIZES = "1,4,16,64"  # MiB of float32 input
DEFAULT_RATIOS = "0.01,0.1,0.5"
DEFAULT_REPEAT = 3  # round trips per cell; the best is reported
DEFAULT_ROW_LEN = 4096  # elements per row in row mode (a hidden size)
LINE_RATE_MBPS = 125.0  # MB/s of a 1 Gbit/s link


def _floats(text: str, what: str, parser: argparse.ArgumentParser) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{what}: expected comma-separated numbers, got {text!r}")
        raise  # unreachable: parser.error exits


def measure(
    numel: int, ratio: float, mode: str, repeat: int, row_len: int
) -> tuple[float, float, float, str]:
    """(encode s, decode s, byte ratio, index encoding) of the best of `repeat` round trips."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    if mode == "row":
        x = x.view(-1, row_len)
    best = (float("inf"), 0.0)
    enc = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        enc = TOPK.encode(x, ratio=ratio, mode=mode)
        t1 = time.perf_counter()
        TOPK.decode(enc, numel)
        t2 = time.perf_counter()
        if t2 - t0 < best[0] + best[1]:
            best = (t1 - t0, t2 - t1)
    assert enc is not None
    return best[0], best[1], numel * 4 / len(enc.data), enc.params["index"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fusionnode bench codec", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help="MiB of float32 input, comma-separated (default %(default)s)"
    )
    parser.add_argument(
        "--ratios", default=DEFAULT_RATIOS, help="keep ratios, comma-separated (default %(default)s)"
    )
    parser.add_argument(
        "--mode",
        choices=("global", "row"),
        default="global",
        help="top-k over the whole tensor or per row (default %(default)s)",
    )
    parser.add_argument(
        "--row-len",
        type=int,
        default=DEFAULT_ROW_LEN,
        help="row length with --mode row (default %(default)s)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=DEFAULT_REPEAT,
        help="timed repetitions per case (the best is kept) (default %(default)s)",
    )
    args = parser.parse_args(argv)
    sizes = _floats(args.sizes, "--sizes", parser)
    ratios = _floats(args.ratios, "--ratios", parser)
    if not sizes or any(s <= 0 for s in sizes):
        parser.error("--sizes must be positive")
    if not ratios or any(not (0 < r <= 1) for r in ratios):
        parser.error("--ratios must be in (0, 1]")
    if args.repeat < 1 or args.row_len < 1:
        parser.error("--repeat and --row-len must be >= 1")
    torch.set_num_threads(1)
    print(
        f"topk codec, mode={args.mode}, 1 torch thread, best of {args.repeat}; line rate 1 Gbit/s = {LINE_RATE_MBPS:g} MB/s"
    )
    print(
        f"{'MiB':>5} {'ratio':>6} {'index':>7} {'enc ms':>8} {'dec ms':>8} {'MB/s':>8} {'x line':>7} {'bytes/x':>8}"
    )
    measure(1 << 16, 0.1, args.mode, 1, min(args.row_len, 1 << 16))  # untimed warm-up: first-call costs
    slowest = float("inf")
    for size in sizes:
        numel = int(size * (1 << 20)) // 4
        if args.mode == "row":
            numel = max(args.row_len, numel // args.row_len * args.row_len)
        for ratio in ratios:
            enc_s, dec_s, byte_ratio, index = measure(numel, ratio, args.mode, args.repeat, args.row_len)
            mbps = numel * 4 / (enc_s + dec_s) / 1e6
            slowest = min(slowest, mbps)
            print(
                f"{size:>5g} {ratio:>6g} {index:>7} {enc_s * 1e3:>8.1f} {dec_s * 1e3:>8.1f} "
                f"{mbps:>8.0f} {mbps / LINE_RATE_MBPS:>7.2f} {byte_ratio:>8.1f}"
            )
    print(f"slowest round trip {slowest:.0f} MB/s = {slowest / LINE_RATE_MBPS:.2f}x the 1 Gbit/s line rate")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
