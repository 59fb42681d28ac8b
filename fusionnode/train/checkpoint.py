"""Atomic, verified training checkpoints.

Layout of a checkpoint directory::

    <dir>/step-00000100/model.safetensors      parameters (each storage once; tied names are aliases)
    <dir>/step-00000100/optimizer.safetensors  every tensor of the optimizer state
    <dir>/step-00000100/manifest.json          step, spec, data state, aliases, optimizer skeleton,
                                               sha256 of both tensor files
    <dir>/latest                               name of the newest checkpoint (informational)

A checkpoint is written into a temporary directory, every file and the directory are fsynced,
and only then is it renamed to `step-XXXXXXXX`; so a `step-*` directory is complete unless
the disk corrupts it, which the manifest's hashes catch. `load_checkpoint` returns the newest
checkpoint that verifies and skips the rest with a warning.

The driver's side (at the end): when a job is checkpointed (`save_at`), what it writes
(`save_job`: every state-dict name, the job secret), how a resume reads it back (`read_resume`,
`load_resume`), and the job secret that proves the driver owns its optimizer shards (`job_secret`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fusionnode.errors import ConfigError
from fusionnode.fsutil import fsync_dir, fsync_file
from fusionnode.train.spec import JobSpec

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "fusionnode-checkpoint"
CHECKPOINT_VERSION = 1
DEFAULT_KEEP = 3  # complete checkpoints kept per directory
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_HASH_CHUNK = 1 << 20  # bytes read at a time when hashing


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or read back as asked."""


@dataclass(frozen=True)
class Checkpoint:
    """One loaded checkpoint. Aliased (tied) parameter names map to the same tensor object."""

    path: Path
    step: int
    params: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    data_state: dict[str, Any]
    spec: JobSpec
    aliases: dict[str, str]  # alias name -> the name its tensor is stored under


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def unique_tensors(params: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Each storage once: names that view exactly the same tensor become aliases of the first name.

    Tensors that share storage without being the same view are cloned, since safetensors refuses
    shared storage.
    """
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_key: dict[tuple[Any, ...], str] = {}
    storages: set[int] = set()
    for name in params:
        t = params[name]
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"parameter {name!r} is a {type(t).__name__}, not a tensor")
        t = t.detach()
        key = _storage_key(t)
        if key in by_key:
            aliases[name] = by_key[key]
            continue
        by_key[key] = name
        out = t.to("cpu").contiguous()
        ptr = out.untyped_storage().data_ptr()
        if ptr in storages or out.data_ptr() == t.data_ptr():
            out = out.clone()  # never hand safetensors a view of live (or shared) memory
        storages.add(out.untyped_storage().data_ptr())
        stored[name] = out
    return stored, aliases


def _split_state(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON skeleton of a nested state; tensors are moved to `tensors` and replaced by references."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": path}
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj):
            if "__tensor__" in obj or "__items__" in obj or "__tuple__" in obj:
                raise CheckpointError(f"optimizer state at {path!r} uses a reserved key")
            return {k: _split_state(v, f"{path}/{k}", tensors) for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CheckpointError(f"optimizer state at {path!r} has a key of type {type(k).__name__}")
            items.append([k, _split_state(v, f"{path}/{k}", tensors)])
        return {"__items__": items}
    if isinstance(obj, tuple):
        return {"__tuple__": [_split_state(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_split_state(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"optimizer state at {path!r} holds a {type(obj).__name__}, which cannot be saved")


def _join_state(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__items__" in obj:
            return {k: _join_state(v, tensors) for k, v in obj["__items__"]}
        if "__tuple__" in obj:
            return tuple(_join_state(v, tensors) for v in obj["__tuple__"])
        return {k: _join_state(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join_state(v, tensors) for v in obj]
    return obj


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST_FILE}.{uuid.uuid4().hex}"
    tmp.write_text(name + "\n", encoding="utf-8")
    fsync_file(tmp)
    os.replace(tmp, root / LATEST_FILE)
    fsync_dir(root)


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step-*` directory under `root`, newest first (not verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def save_checkpoint(
    directory: str | Path,
    step: int,
    params: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    data_state: Mapping[str, Any],
    spec: JobSpec,
    *,
    keep: int = DEFAULT_KEEP,
) -> Path:
    """Write a checkpoint of `step` atomically; keep the newest `keep`. Returns its directory.

    One writer per directory: stale temporary directories left by a crashed writer are removed.
    """
    if step < 0:
        raise CheckpointError(f"step must be >= 0, got {step}")
    if keep < 1:
        raise CheckpointError(f"keep must be >= 1, got {keep}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)

    name = step_dir_name(step)
    tmp = root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        stored, aliases = unique_tensors(params)
        opt_tensors: dict[str, torch.Tensor] = {}
        skeleton = _split_state(dict(optimizer_state), "opt", opt_tensors)
        save_file(stored, str(tmp / MODEL_FILE))
        save_file(opt_tensors, str(tmp / OPTIMIZER_FILE))
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "step": step,
            "created": time.time(),
            "spec": spec.to_dict(),
            "data_state": dict(data_state),
            "aliases": aliases,
            "param_names": list(params),
            "optimizer": skeleton,
            "sha256": {f: _sha256(tmp / f) for f in (MODEL_FILE, OPTIMIZER_FILE)},
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, allow_nan=False), encoding="utf-8")
        for f in (MODEL_FILE, OPTIMIZER_FILE, MANIFEST_FILE):
            fsync_file(tmp / f)
        fsync_dir(tmp)

        final = root / name
        trash = None
        if final.exists():  # re-saving a step (after a resume): move the old one out of the way first
            trash = root / f".tmp-step-trash-{uuid.uuid4().hex[:8]}"
            os.replace(final, trash)
        os.replace(tmp, final)
        fsync_dir(root)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_latest(root, name)
    for _, old in list_checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    logger.info("checkpoint step %d saved to %s", step, final)
    return final


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read and verify one `step-*` directory; raise CheckpointError if it is incomplete or corrupt."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not a FusionNode checkpoint")
    if manifest.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint version {manifest.get('version')}, expected {CHECKPOINT_VERSION}"
        )
    try:
        for f in (MODEL_FILE, OPTIMIZER_FILE):
            actual = _sha256(path / f)
            if actual != manifest["sha256"][f]:
                raise CheckpointError(f"{path}/{f}: sha256 mismatch (corrupt or partly written)")
        stored = load_file(str(path / MODEL_FILE))
        opt_tensors = load_file(str(path / OPTIMIZER_FILE))
        aliases = dict(manifest["aliases"])
        params: dict[str, torch.Tensor] = {}
        for name in manifest["param_names"]:
            params[name] = stored[aliases.get(name, name)]
        optimizer_state = _join_state(manifest["optimizer"], opt_tensors)
        spec = JobSpec.from_dict(manifest["spec"])
        step = int(manifest["step"])
        data_state = dict(manifest["data_state"])
    except CheckpointError:
        raise
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: invalid checkpoint: {exc!r}") from exc
    return Checkpoint(
        path=path,
        step=step,
        params=params,
        optimizer_state=optimizer_state,
        data_state=data_state,
        spec=spec,
        aliases=aliases,
    )


def load_checkpoint(directory: str | Path) -> Checkpoint | None:
    """The newest complete, verified checkpoint under `directory`, or None if there is none.

    Incomplete temporary directories are never considered; a corrupt checkpoint is skipped with
    a warning and the next older one is tried.
    """
    for _, path in list_checkpoints(directory):
        try:
            return read_checkpoint(path)
        except CheckpointError as exc:
            logger.warning("skipping checkpoint: %s", exc)
    return None


# ---- the driver's side -------------------------------------------------------------------------
JOB_SECRET_FILE = "job_secret.key"  # in the driver's state dir: 32 random bytes, job secrets derive from it


def save_at(spec: Any, step: int) -> bool:
    """Whether the job is checkpointed after `step` steps (every save_every, and the last)."""
    return bool(spec.save_dir) and (
        step == spec.steps or bool(spec.save_every and step % spec.save_every == 0)
    )


def save_job(
    job: Any,
    step: int,
    source: Any,
    params: Mapping[str, torch.Tensor],
    feedback: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
    worker_optim: Mapping[str, torch.Tensor] | None = None,
) -> str:
    """Saves every state-dict name of a job's model (tied weights under each of their names, stored
    once), so the checkpoint loads strictly into the model (`fusionnode generate`, `export`), with
    the job secret and the data source's state; `feedback` (--sync sparseloco): each replica's
    error-feedback accumulators, by name (the outer state the workers keep); `worker_optim`
    (--offload off): the workers' optimizer state, `<name>|<kind>` tensors (runtime/optstate.py)."""
    full = {**params, **{alias: params[name] for alias, name in job.aliases.items() if name in params}}
    state: dict[str, Any] = {"job_secret": job.secret}
    if job.sync.rounds:  # the job's H: a --resume keeps it (train/jobdefaults.py)
        state["sync"] = job.sync.to_dict()
    if feedback:
        state["feedback"] = {int(r): dict(acc) for r, acc in feedback.items()}
    if worker_optim:
        state["worker_optim"] = dict(worker_optim)
    path = save_checkpoint(job.spec.save_dir, step, full, state, source.state(step), job.spec)
    return str(path)


def read_resume(spec: Any) -> Checkpoint:
    """The driver's checkpoint in the job's --save directory (ConfigError without one)."""
    if not spec.save_dir:
        raise ConfigError("--resume needs the checkpoint directory (--save)")
    ckpt = load_checkpoint(spec.save_dir)
    if ckpt is None:
        raise ConfigError(f"--resume: no complete checkpoint in {spec.save_dir}")
    return ckpt


def checkpoint_feedback(ckpt: Checkpoint | None) -> dict[int, dict[str, torch.Tensor]]:
    """The --sync sparseloco error feedback a checkpoint holds (per replica, by name); {} if none."""
    raw = (ckpt.optimizer_state or {}).get("feedback") if ckpt is not None else None
    if not isinstance(raw, Mapping):
        return {}
    return {
        int(r): {str(n): t.float() for n, t in acc.items() if isinstance(t, torch.Tensor)}
        for r, acc in raw.items()
        if isinstance(acc, Mapping)
    }


def checkpoint_worker_optim(
    ckpt: Checkpoint | None, names: Iterable[str]
) -> dict[str, dict[str, torch.Tensor]] | None:
    """The workers' optimizer state a --offload off checkpoint holds, name -> its `<name>|<kind>`
    tensors (what `Placement.ship` sends a stage), for every one of `names`; None when it holds
    none, or not every name's (an older checkpoint: the stages start new optimizer state)."""
    raw = (ckpt.optimizer_state or {}).get("worker_optim") if ckpt is not None else None
    if not isinstance(raw, Mapping):
        return None
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        if isinstance(key, str) and "|" in key and isinstance(t, torch.Tensor):
            out.setdefault(key.rpartition("|")[0], {})[key] = t.float()
    return out if set(names) <= set(out) else None


def load_resume(
    ckpt: Checkpoint, source: Any, full: Mapping[str, torch.Tensor]
) -> tuple[int, dict[str, torch.Tensor], str | None]:
    """(step, parameters, job secret) of the driver's checkpoint."""
    step = source.check_state(ckpt.data_state)
    secret = (ckpt.optimizer_state or {}).get("job_secret")
    return (
        step,
        {name: ckpt.params[name].float() for name in full},
        secret if isinstance(secret, str) else None,
    )


def job_secret(state_dir: str | Path, job_id: str) -> str:
    """The secret that proves a driver owns a job's optimizer shards: derived from a random key in the
    driver's state directory (so a rerun of the same job uses the same shard directory), written
    into every checkpoint of the job (so a resume elsewhere proves it too)."""
    path = Path(state_dir) / JOB_SECRET_FILE
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        key = secrets.token_bytes(32)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
    return hmac.new(key, job_id.encode(), hashlib.sha256).hexdigest()[:32]
