"""Optimizer-host benchmark: AdamW step throughput, and what offload saves a worker in memory.

Method.
- Throughput: a set of fp32 tensors shaped like GPT-2 blocks (n_embd 768: c_attn, c_proj,
  c_fc, mlp c_proj weights and biases, two layer norms) plus an embedding, `--params` elements
  in all. The same fixed random gradients are applied every step. After `--warmup` rounds,
  `--steps` rounds are timed with time.perf_counter, the three contenders in rotation within
  each round (so load from other processes hits all alike), and the median per contender is
  reported, for
  (a) FlatOptimizer.step, (b) torch.optim.AdamW(foreach=True), (c) a ParameterStore step:
  one contributor pushes every gradient (shape, dtype, finiteness checks and accumulation) and
  apply() runs the update. Throughput = parameters / median step time. torch threads:
  `--threads` (default 1; the test machine is shared).
- Memory (arithmetic, not measured): bytes a worker holds for its parameters and gradients,
  without offload (plus AdamW's two fp32 state tensors and, for a bf16 worker, fp32 masters)
  and with offload (parameters and gradients only). Parameter counts come from the bundled
  GPT-2 configurations built on the meta device. Activations are not included.

Run: python -m fusionnode.bench.optim [--params 25000000] [--steps 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable

import torch

from fusionnode.optim.contributions import Contributor, ExpectedContributions
from fusionnode.optim.optimizers import FlatOptimizer, OptimizerConfig
from fusionnode.optim.store import ParameterStore

logger = logging.getLogger(__name__)

DEFAULT_PARAMS = 25_000_000  # elements
DEFAULT_STEPS = 5  # timed steps per optimizer
DEFAULT_WARMUP = 2  # untimed steps per optimizer
DEFAULT_THREADS = 1
BENCH_EMBD = 768  # hidden size of the synthetic GPT-2-like tensors
MEMORY_MODELS = ("gpt2-tiny", "gpt2-small", "gpt2-medium")
GiB = 1 << 30


def synthetic_shapes(total: int, d: int = BENCH_EMBD) -> dict[str, tuple[int, ...]]:
    """GPT-2-block-shaped tensors plus an embedding whose rows fill up to about `total` elements."""
    block = {
        "ln_1.weight": (d,),
        "ln_1.bias": (d,),
        "attn.c_attn.weight": (3 * d, d),
        "attn.c_attn.bias": (3 * d,),
        "attn.c_proj.weight": (d, d),
        "attn.c_proj.bias": (d,),
        "ln_2.weight": (d,),
        "ln_2.bias": (d,),
        "mlp.c_fc.weight": (4 * d, d),
        "mlp.c_fc.bias": (4 * d,),
        "mlp.c_proj.weight": (d, 4 * d),
        "mlp.c_proj.bias": (d,),
    }
    per_block = sum(torch.Size(s).numel() for s in block.values())
    n_blocks = max(1, total // per_block)
    shapes = {f"h.{i}.{k}": s for i in range(n_blocks) for k, s in block.items()}
    rows = (total - n_blocks * per_block) // d
    if rows > 0:
        shapes["wte.weight"] = (rows, d)
    return shapes


def _time_interleaved(fns: dict[str, Callable[[], None]], warmup: int, steps: int) -> dict[str, float]:
    """Median seconds per call of each function, timed in rotation so that load changes hit all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(steps):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def throughput(total: int, steps: int, warmup: int) -> dict[str, float]:
    shapes = synthetic_shapes(total)
    g = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
    grads = {n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes.items()}
    n_params = sum(t.numel() for t in init.values())
    cfg = OptimizerConfig("adamw", lr=3e-4, weight_decay=0.1)

    flat = FlatOptimizer({n: t.clone() for n, t in init.items()}, cfg)

    params = [torch.nn.Parameter(t.clone()) for t in init.values()]
    for p, gr in zip(params, grads.values(), strict=True):
        p.grad = gr
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    topt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=cfg.betas,
        foreach=True,
    )

    store = ParameterStore(
        "bench", init, cfg, ExpectedContributions.same_for_all(init, {"r0/s0": Contributor("r0", 1)})
    )

    def store_step() -> None:
        step = store.applied_step + 1
        for n, gr in grads.items():
            store.push(step, "r0/s0", n, gr, 1)
        if not store.apply(step).applied:
            raise RuntimeError("benchmark step did not apply")

    t = _time_interleaved(
        {"flat": lambda: flat.step(grads, cfg.lr), "torch": topt.step, "store": store_step}, warmup, steps
    )
    return {
        "params": n_params,
        "tensors": len(shapes),
        "flat_step_s": t["flat"],
        "torch_foreach_step_s": t["torch"],
        "store_push_apply_s": t["store"],
        "flat_params_per_s": n_params / t["flat"],
        "torch_params_per_s": n_params / t["torch"],
        "store_params_per_s": n_params / t["store"],
    }


def memory_table(models: tuple[str, ...] = MEMORY_MODELS) -> list[dict[str, float]]:
    from fusionnode.models.gpt2 import CONFIGS, GPT2

    rows = []
    for name in models:
        with torch.device("meta"):
            n = sum(p.numel() for p in GPT2(CONFIGS[name]).parameters())
        adam_state = 8 * n  # exp_avg + exp_avg_sq, fp32
        rows.append(
            {
                "model": name,
                "params": n,
                # fp32 worker: params + grads (+ Adam state when local)
                "fp32_local_bytes": 4 * n + 4 * n + adam_state,
                "fp32_offload_bytes": 4 * n + 4 * n,
                # bf16 worker: bf16 params + grads (+ fp32 masters and Adam state when local)
                "bf16_local_bytes": 2 * n + 2 * n + 4 * n + adam_state,
                "bf16_offload_bytes": 2 * n + 2 * n,
                # what the optimizer hosts hold in all: fp32 masters + Adam state
                "host_total_bytes": 4 * n + adam_state,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fusionnode bench optim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=DEFAULT_PARAMS, help="elements (default %(default)s)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="timed steps (default %(default)s)")
    parser.add_argument(
        "--warmup", type=int, default=DEFAULT_WARMUP, help="untimed steps (default %(default)s)"
    )
    parser.add_argument(
        "--threads", type=int, default=DEFAULT_THREADS, help="torch threads (default %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if args.params < 1 or args.steps < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--params, --steps and --threads must be >= 1, --warmup >= 0")
    torch.set_num_threads(args.threads)
    tp = throughput(args.params, args.steps, args.warmup)
    mem = memory_table()
    if args.json:
        print(json.dumps({"threads": args.threads, "throughput": tp, "memory": mem}))
        return 0
    print(
        f"AdamW step, {tp['params'] / 1e6:.1f}M params in {tp['tensors']} tensors, {args.threads} thread(s):"
    )
    for label, key in (
        ("FlatOptimizer", "flat"),
        ("torch.optim.AdamW foreach", "torch_foreach"),
        ("ParameterStore push+apply", "store"),
    ):
        t = tp[f"{key}_step_s" if key != "store" else "store_push_apply_s"]
        rate = tp[f"{key if key != 'torch_foreach' else 'torch'}_params_per_s"]
        print(f"  {label:28s} {t * 1e3:9.1f} ms/step  {rate / 1e6:8.1f} M params/s")
    print("Worker memory for params + grads (+ optimizer state when local), GiB; activations excluded:")
    print(
        f"  {'model':12s} {'params':>12s} {'fp32 local':>11s} {'fp32 offl.':>11s} {'bf16 local':>11s} {'bf16 offl.':>11s}"
    )
    for r in mem:
        print(
            f"  {r['model']:12s} {r['params']:12,d} {r['fp32_local_bytes'] / GiB:11.3f} {r['fp32_offload_bytes'] / GiB:11.3f}"
            f" {r['bf16_local_bytes'] / GiB:11.3f} {r['bf16_offload_bytes'] / GiB:11.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
