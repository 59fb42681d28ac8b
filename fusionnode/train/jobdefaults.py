"""What the driver settles of a job's request before it plans it, where the swarm is known.

- `--compress auto` (train's default): AdaTopK, also where the job's spot-checks run (a public swarm,
  or `--verify-policy sample|all`): the checks compare what a stage sent with what its link codec
  makes of the recompute (verify/lossy.py).
- AdaTopK's warm-up on 8-bit links (what kept convergence: protocol/COMPRESSION.md).
- The link options' ``dither`` written out ("keyed" unless asked): a worker reads an absent one as
  an older driver's "counter"; an option this version does not know refuses the job.
- `--resume` of a round mode: the job's H is the one its checkpoint recorded (`save_job`), not one
  chosen anew for `--sync-budget` (the optimizer hosts' round ids were counted at the old H).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fusionnode.compress.link import DEFAULT_DITHER, LinkOptions
from fusionnode.errors import ConfigError
from fusionnode.sync import SyncConfig

AUTO_COMPRESS = "auto"  # the driver chooses: adatopk (spot-checked jobs included)
ADATOPK_WARMUP_FRACTION = 0.3  # share of a job's steps sent with the warm-up codec before top-k starts


def resolve_compress(spec: Any, params: Mapping[str, Any], config: Any) -> Any:
    """`spec` with `--compress auto` resolved to `adatopk` (the spot-checks judge lossy links within
    their codec's bounds, so a checked job need not keep dense links). Any other setting is the
    user's and stays."""
    if spec.compress != AUTO_COMPRESS:
        return spec
    return dataclasses.replace(spec, compress="adatopk")


def resumed_sync(params: Mapping[str, Any], saved: Any) -> dict[str, Any]:
    """`params` with the sync a resumed job ran (`saved`: the checkpoint's record, None for one written
    before H was recorded). A round mode's H stays the checkpoint's: a --sync-budget (H to be chosen)
    takes it; an explicit H that differs is refused (ConfigError naming --inner-steps)."""
    out = dict(params)
    if not isinstance(saved, Mapping):
        return out
    old = SyncConfig.from_dict(saved)
    new = SyncConfig.from_dict(params.get("sync"))
    if not (old.rounds and new.rounds):
        return out
    if new.budget is not None:
        out["sync"] = dataclasses.replace(new, inner_steps=old.inner_steps, budget=None).to_dict()
    elif new.inner_steps != old.inner_steps:
        raise ConfigError(
            f"--inner-steps {new.inner_steps}: the checkpoint's job ran rounds of H = {old.inner_steps}, "
            f"and its optimizer hosts count rounds at that H; resume with --inner-steps {old.inner_steps} "
            "(or with --sync-budget, which keeps the checkpoint's H)"
        )
    warm = (old.warmup_steps, old.warmup_inner_steps)
    if (new.warmup_steps, new.warmup_inner_steps) != warm:
        raise ConfigError(
            f"--sync-warmup {new.warmup_steps} --warmup-inner-steps {new.warmup_inner_steps}: the checkpoint's "
            f"job ran --sync-warmup {warm[0]} --warmup-inner-steps {warm[1]}, and its optimizer hosts count "
            "rounds by that schedule; resume with the same"
        )
    return out


def job_defaults(spec: Any, params: dict[str, Any], ckpt: Any, config: Any) -> tuple[Any, dict[str, Any]]:
    """(spec, params) of a job with the driver's defaults settled (the module's docstring)."""
    if ckpt is not None:
        params = resumed_sync(params, (ckpt.optimizer_state or {}).get("sync"))
    spec = resolve_compress(spec, params, config)
    link_options = dict(params.get("link_options") or {})
    LinkOptions.from_dict(link_options)  # an unknown option: ConfigError naming it, before anything starts
    # written out: a worker reads an absent dither as the old "counter" (an older driver's links)
    link_options.setdefault("dither", DEFAULT_DITHER)
    if spec.compress == "adatopk":
        link_options.setdefault("warmup_steps", int(ADATOPK_WARMUP_FRACTION * spec.steps))
    return spec, {**params, "link_options": link_options}
