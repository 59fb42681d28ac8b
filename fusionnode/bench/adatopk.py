"""AdaTopK convergence benchmark: dense vs compressed training of gpt2-tiny cut in two, in one process.

Method: the model is split after block `--cut` (embeddings + blocks [0, cut) are stage 0,
the rest stage 1); the cut is a `CompressionBoundary`: the runtime's own link compressors
(compress/link.py, one per direction, as a worker has) encode the activation crossing it
forward and its gradient backward, which then go through the real wire path (packed
bytes). Both runs start from the same weights (same seed) and see the same batches
(fusionnode.train.data, default corpus). The compressed run's keep ratio comes from the
compressors' `AdaTopKPolicy` on a simulated link of `--link-mbps` and `--latency-ms`
whose compute-bound stage time is `--stage-ms`: each compressor observes the simulated
transfer time of its messages, as a worker observes its sends. Reported: final validation loss of both runs (the
compressed run evaluated with the cut still compressing, as a deployed pipeline would),
their relative difference, the keep ratios chosen and the byte reduction on the link.
Defaults are what the runtime sends (protocol/COMPRESSION.md, "Keep-ratio floor"):
activations as centered global top-k at the policy's keep ratio; activation gradients
as per-row int8 ("q8", seeded stochastic rounding) whenever the policy compresses (top-k
of gradients is what cost most convergence); no warm-up (`--warmup` sets one); a 9.5 Mbit/s
link, on which the policy sits at its keep-ratio floor (`--keep-floor`, default AdaTopK's:
compress/policy.py DEFAULT_K_MIN, the figure a plan may count on). Bytes are counted over
both directions of the link. Exit status 0 only when the loss is within 5% and bytes drop >= 5x.

Run: python -m fusionnode.bench.adatopk [--steps N] [--forward-mode row|global] ...
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import time

import torch
import torch.nn.functional as F

from fusionnode.compress.boundary import CompressionBoundary, LinkCounters
from fusionnode.compress.link import LinkOptions
from fusionnode.compress.policy import DEFAULT_K_MIN
from fusionnode.models import build_model
from fusionnode.train.data import BatchSource, load_corpus

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "gpt2-tiny"
DEFAULT_STEPS = 400  # optimizer steps (about 2-3 minutes for both runs on one idle CPU thread)
DEFAULT_BATCH = 16  # sequences per step
DEFAULT_SEQ_LEN = 128  # tokens
DEFAULT_LR = 2e-3  # AdamW learning rate
DEFAULT_SEED = 0
DEFAULT_CUT = 2  # blocks before the cut
DEFAULT_LINK_MBPS = (
    9.5  # Mbit/s: a home uplink; the policy would keep 9.6% of the activation, the floor stops it
)
DEFAULT_LATENCY_MS = 10.0  # ms one-way
DEFAULT_STAGE_MS = 100.0  # ms: compute-bound stage time the link must keep up with
DEFAULT_EVAL_BATCHES = 8  # validation batches averaged for the final loss
DEFAULT_WARMUP_FRACTION = 0.0  # of --steps sent q8 both ways before top-k starts (when --warmup is not given)
DEFAULT_FORWARD_MODE = "global"  # activations: global top-k of the centered tensor converged best
DEFAULT_BACKWARD_MODE = "global"  # activation gradients
DEFAULT_CENTER = True  # centered top-k for activations
DEFAULT_BACKWARD_CODEC = "q8"  # activation gradients: per-row int8, stochastic rounding
DEFAULT_WARMUP_CODEC = "q8"  # warm-up steps send q8 both ways (raw float32 warm-up alone costs 2x its bytes)
LOSS_TOLERANCE = 0.05  # relative loss difference the issue accepts
MIN_REDUCTION = 5.0  # byte reduction the issue asks for


@dataclasses.dataclass(frozen=True)
class RunResult:
    final_loss: float  # mean validation loss at the end (cut compressing for the compressed run)
    train_loss: float  # mean training loss over the last 10% of steps
    link: LinkCounters  # both directions of the cut
    forward_ratio: float  # keep ratio in force at the last step (activations)
    backward_ratio: float  # same, activation gradients
    seconds: float
    forward_link: LinkCounters = dataclasses.field(default_factory=LinkCounters)  # activations only
    backward_link: LinkCounters = dataclasses.field(default_factory=LinkCounters)  # gradients only


def split_forward(
    model: torch.nn.Module, ids: torch.Tensor, cut: int, boundary: CompressionBoundary | None
) -> torch.Tensor:
    """gpt2 forward with `boundary` applied to the residual stream before block `cut`."""
    tr = model.transformer
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    x = tr["drop"](tr["wte"](ids) + tr["wpe"](pos))
    for i, block in enumerate(tr["h"]):
        if i == cut and boundary is not None:
            x = boundary(x)
        x = block(x)
    return model.lm_head(tr["ln_f"](x))


def train(
    args: argparse.Namespace,
    source: BatchSource,
    config: LinkOptions | None,
    link_bps: float | None,
    backward_config: LinkOptions | None = None,
) -> RunResult:
    """One run; `config` None is the dense baseline (no boundary at all). `config` (and
    `backward_config` for the gradients, else the same) are the link options; with `link_bps`
    the keep ratio is AdaTopK's on that link, else the fixed `args.ratio` (gradients dense with
    `args.dense_backward`)."""
    torch.manual_seed(args.seed)
    model = build_model(args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    boundary = None
    if config is not None:
        spec = "adatopk" if link_bps is not None else f"topk:{args.ratio}"
        boundary = CompressionBoundary.of(
            spec,
            config,
            backward_spec="none" if link_bps is None and args.dense_backward else spec,
            backward_options=backward_config,
            bandwidth_bps=link_bps,
            latency_s=args.latency_ms / 1e3,
            target_time_s=args.stage_ms / 1e3,
        )
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        ids, targets = source.batch(step)
        if boundary is not None:
            before = (boundary.forward_counters.wire_bytes, boundary.backward_counters.wire_bytes)
        logits = split_forward(model, ids, args.cut, boundary)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if boundary is not None:
            if link_bps is not None:
                sent = (
                    boundary.forward_counters.wire_bytes - before[0],
                    boundary.backward_counters.wire_bytes - before[1],
                )
                for link, nbytes in zip((boundary.forward, boundary.backward), sent, strict=True):
                    link.observe(nbytes, nbytes * 8.0 / link_bps)  # simulated transfer time
            boundary.next_step()
        if args.log_every and step % args.log_every == 0:
            logger.info("step %d loss %.4f", step, losses[-1])
    seconds = time.perf_counter() - t0
    link = boundary.counters if boundary is not None else LinkCounters()
    with torch.no_grad():
        evals = []
        for i in range(args.eval_batches):
            ids, targets = source.eval_batch(i)
            logits = split_forward(model, ids, args.cut, boundary)
            evals.append(float(F.cross_entropy(logits.flatten(0, 1), targets.flatten())))
    tail = losses[-max(1, len(losses) // 10) :]
    return RunResult(
        final_loss=sum(evals) / len(evals),
        train_loss=sum(tail) / len(tail),
        link=link,
        forward_ratio=boundary.forward_ratio if boundary else 1.0,
        backward_ratio=boundary.backward_ratio if boundary else 1.0,
        seconds=seconds,
        forward_link=boundary.forward_counters if boundary else LinkCounters(),
        backward_link=boundary.backward_counters if boundary else LinkCounters(),
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusionnode bench adatopk", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps (default %(default)s)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="bundled model (default %(default)s)")
    p.add_argument(
        "--batch-size", type=int, default=DEFAULT_BATCH, help="sequences per step (default %(default)s)"
    )
    p.add_argument("--lr", type=float, default=DEFAULT_LR, help="peak learning rate (default %(default)s)")
    p.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help="seed of the model, data and rounding (default %(default)s)",
    )
    p.add_argument("--cut", type=int, default=DEFAULT_CUT, help="blocks before the cut (default %(default)s)")
    p.add_argument(
        "--link-mbps",
        type=float,
        default=DEFAULT_LINK_MBPS,
        help="simulated link, Mbit/s (default %(default)s)",
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=DEFAULT_LATENCY_MS,
        help="simulated link latency, ms (default %(default)s)",
    )
    p.add_argument(
        "--stage-ms",
        type=float,
        default=DEFAULT_STAGE_MS,
        help="compute-bound stage time, ms (default %(default)s)",
    )
    p.add_argument("--ratio", type=float, default=None, help="fixed keep ratio instead of the policy")
    p.add_argument(
        "--keep-floor",
        type=float,
        default=DEFAULT_K_MIN,
        help="smallest keep ratio the policy may choose (default %(default)s: AdaTopK's floor)",
    )
    p.add_argument(
        "--forward-mode",
        choices=("row", "global"),
        default=DEFAULT_FORWARD_MODE,
        help="top-k over each row or the whole activation (default %(default)s)",
    )
    p.add_argument(
        "--backward-mode",
        choices=("row", "global"),
        default=DEFAULT_BACKWARD_MODE,
        help="top-k over each row or the whole gradient (default %(default)s)",
    )
    p.add_argument(
        "--center",
        action=argparse.BooleanOptionalAction,
        default=DEFAULT_CENTER,
        help="centered top-k of activations: channel means sent, dropped elements decode to them (default %(default)s)",
    )
    p.add_argument("--center-backward", action="store_true", help="centered top-k of activation gradients")
    p.add_argument(
        "--value-dtype",
        choices=("float16", "bfloat16", "float32"),
        default="float16",
        help="dtype of the kept values on the wire (default %(default)s)",
    )
    p.add_argument("--forward-feedback", action="store_true", help="error feedback on activations")
    p.add_argument("--backward-feedback", action="store_true", help="error feedback on activation gradients")
    p.add_argument("--dense-backward", action="store_true", help="send activation gradients dense")
    p.add_argument(
        "--backward-codec",
        choices=("topk", "q8", "q4"),
        default=DEFAULT_BACKWARD_CODEC,
        help="activation gradients while compressing: top-k at the policy's ratio, or per-row int8/int4 (default %(default)s)",
    )
    p.add_argument(
        "--warmup-codec",
        choices=("raw", "q8", "q4"),
        default=DEFAULT_WARMUP_CODEC,
        help="what warm-up steps send in both directions (raw = the dense float32 tensor) (default %(default)s)",
    )
    p.add_argument(
        "--stochastic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="q8/q4: seeded stochastic rounding (unbiased) instead of nearest (default %(default)s)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"warm-up steps (sent with --warmup-codec) before top-k starts (default {DEFAULT_WARMUP_FRACTION:g} of --steps)",
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=DEFAULT_EVAL_BATCHES,
        help="validation batches at the end (default %(default)s)",
    )
    p.add_argument("--log-every", type=int, default=0, help="print every N steps; 0 = only the summary")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_batches < 1:
        parser.error("--steps and --eval-batches must be >= 1")
    if args.warmup is None:
        args.warmup = int(args.steps * DEFAULT_WARMUP_FRACTION)
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.ratio is not None and not (0.0 < args.ratio <= 1.0):
        parser.error("--ratio must be in (0, 1]")
    if args.link_mbps <= 0:
        parser.error("--link-mbps must be > 0")
    if not (0.0 < args.keep_floor <= 1.0):
        parser.error("--keep-floor must be in (0, 1]")
    torch.set_num_threads(1)
    model_cfg = build_model(args.model).config
    if not (0 < args.cut < model_cfg.n_layer):
        parser.error(f"--cut must be in [1, {model_cfg.n_layer - 1}]")
    source = BatchSource(load_corpus(), batch_size=args.batch_size, seq_len=model_cfg.n_ctx, seed=args.seed)
    config = LinkOptions(
        mode=args.forward_mode,
        value_dtype=args.value_dtype,
        center=args.center,
        error_feedback=args.forward_feedback,
        warmup_steps=args.warmup,
        grad_codec=args.backward_codec,
        stochastic=args.stochastic,
        warmup_codec=args.warmup_codec,
        k_min=args.keep_floor,
    )
    backward_config = dataclasses.replace(
        config,
        mode=args.backward_mode,
        center=args.center_backward,
        center_gradients=args.center_backward,
        error_feedback=args.backward_feedback,
    )
    link_bps = None if args.ratio is not None else args.link_mbps * 1e6
    if link_bps is not None and args.dense_backward:
        parser.error("--dense-backward needs a fixed --ratio")
    dense = train(args, source, None, None)
    comp = train(args, source, config, link_bps, backward_config)
    rel = (comp.final_loss - dense.final_loss) / dense.final_loss
    print(
        f"model {args.model}, {args.steps} steps, batch {args.batch_size}x{model_cfg.n_ctx}, cut after block {args.cut}"
    )
    if link_bps is not None:
        print(
            f"link {args.link_mbps:g} Mbit/s, latency {args.latency_ms:g} ms, stage {args.stage_ms:g} ms "
            f"-> keep ratio fwd {comp.forward_ratio:.4f} bwd {comp.backward_ratio:.4f}"
            + (f" (gradients sent {args.backward_codec}, not top-k)" if args.backward_codec != "topk" else "")
        )
    else:
        print(f"fixed keep ratio {args.ratio:g}")
    if args.backward_codec == "topk":
        bwd_desc = f"topk-{args.backward_mode}{'+center' if args.center_backward else ''}"
    else:
        bwd_desc = f"{args.backward_codec}-{'stochastic' if args.stochastic else 'nearest'}"
    print(
        f"modes fwd={args.forward_mode}{'+center' if args.center else ''} "
        f"bwd={'dense' if args.dense_backward else bwd_desc} "
        f"values={args.value_dtype} fwd_ef={args.forward_feedback} bwd_ef={args.backward_feedback} "
        f"warmup={args.warmup} ({args.warmup_codec})"
    )
    print(
        f"dense      val loss {dense.final_loss:.4f}  train loss {dense.train_loss:.4f}  ({dense.seconds:.1f} s)"
    )
    print(
        f"compressed val loss {comp.final_loss:.4f}  train loss {comp.train_loss:.4f}  ({comp.seconds:.1f} s)"
    )
    print(f"relative loss difference {rel * 100:+.2f}% (tolerance {LOSS_TOLERANCE * 100:.0f}%)")
    c = comp.link
    print(
        f"link bytes: dense {c.dense_bytes} wire {c.wire_bytes} -> {c.reduction:.2f}x fewer "
        f"(required >= {MIN_REDUCTION:g}x)"
    )
    print(
        f"  activations {comp.forward_link.reduction:.2f}x fewer, gradients {comp.backward_link.reduction:.2f}x fewer"
    )
    ok = abs(rel) <= LOSS_TOLERANCE and c.reduction >= MIN_REDUCTION and math.isfinite(comp.final_loss)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
