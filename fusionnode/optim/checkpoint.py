"""Atomic, durable checkpoints of one optimizer host's shard.

Layout: DIR/<job_id>/<host_id>/step-<step:010d>/{tensors.safetensors, manifest.json}.

A checkpoint is written into a hidden temporary directory next to the final one: the tensor file
(safetensors format, streamed in chunks while its sha256 is computed), then the manifest (step,
names, per-name optimizer step counts, optimizer config, sha256 and size of the tensor file).
Both files and the directory are fsync'ed, the directory is renamed to its final name, and the
parent is fsync'ed. The rename is the commit: a crash or a write error (disk full) before it
leaves the earlier checkpoints untouched, and the temporary directory is removed (or ignored and
swept by the next save). The last `keep` complete checkpoints are kept.

One writer per (job, host) directory is assumed (one optimizer host process).
Loading picks the newest checkpoint whose manifest parses and whose tensor file matches its hash,
skipping incomplete or corrupt ones with a warning.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, BinaryIO

import safetensors
import safetensors.torch
import torch

from fusionnode.errors import ConfigError, FusionNodeError
from fusionnode.fsutil import fsync_dir
from fusionnode.optim.store import ParameterStore, StepOrderError

logger = logging.getLogger(__name__)

OUTER_BUF = "outer_buf"  # tensor-name prefix of a round mode's outer optimizer state
DEFAULT_KEEP = 3  # complete checkpoints kept per (job, host)
CHUNK_BYTES = 16 << 20  # bytes per write call while streaming tensors
FORMAT_VERSION = 1
TENSOR_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{10})$")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class CheckpointError(FusionNodeError, OSError):
    """A checkpoint could not be written; the previous checkpoints are intact. Keeps the errno."""


def _shard_dir(root: Path, job_id: str, host_id: str) -> Path:
    for label, value in (("job_id", job_id), ("host_id", host_id)):
        if not _SAFE_ID.match(value) or value in (".", ".."):
            raise ConfigError(f"{label} {value!r} is not usable as a directory name")
    return Path(root) / job_id / host_id


def _write_chunk(f: BinaryIO, data: memoryview | bytes) -> None:
    """One write call (module-level so tests can inject a full disk)."""
    f.write(data)


def _flatten(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": t for n, t in state["params"].items()}
    for kind, tensors in state["state"].items():
        out.update({f"{kind}/{n}": t for n, t in tensors.items()})
    return out


def _write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> tuple[str, int]:
    """Stream `tensors` to `path` in safetensors format; returns (sha256 hex, bytes). fsyncs the file."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    order = sorted(tensors)
    flat: list[torch.Tensor] = []
    for key in order:
        t = tensors[key].detach().cpu().contiguous()
        if t.dtype not in _DTYPES:
            raise ConfigError(f"cannot checkpoint tensor {key!r} of dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        header[key] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        flat.append(t)
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)
    digest = hashlib.sha256()
    total = 0
    with open(path, "wb") as f:
        for chunk in (len(hjson).to_bytes(8, "little"), hjson):
            digest.update(chunk)
            _write_chunk(f, chunk)
            total += len(chunk)
        for t in flat:
            if t.numel() == 0:
                continue
            buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            for start in range(0, len(buf), CHUNK_BYTES):
                piece = buf[start : start + CHUNK_BYTES]
                digest.update(piece)
                _write_chunk(f, piece)
                total += len(piece)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest(), total


def _complete_steps(shard_dir: Path) -> list[tuple[int, Path]]:
    if not shard_dir.is_dir():
        return []
    found = []
    for entry in shard_dir.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def save_shard(
    dir: Path,
    job_id: str,
    host_id: str,
    step: int,
    store: ParameterStore,
    *,
    keep: int = DEFAULT_KEEP,
    owner: dict[str, str] | None = None,
    rounds: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write the store's state at `step` atomically; returns the checkpoint directory.

    `step` must equal the store's applied_step (pause applies while saving for a consistent
    cut across hosts). `owner` (the owning driver's peer id and owner tag) goes into the manifest and
    must match when the shard is loaded. `rounds` (--sync diloco|sparseloco, issue 19): the outer
    state, `RoundCombiner.state()`: its scalars go into the manifest, its tensors beside the
    parameters ("outer_buf/<name>"). Raises CheckpointError (an OSError keeping errno, e.g. ENOSPC) when
    writing fails, after removing the partial files; the earlier checkpoints stay.
    """
    if keep < 1:
        raise ConfigError("keep must be >= 1")
    shard_dir = _shard_dir(dir, job_id, host_id)
    state = store.state_dict()
    if state["applied_step"] != step:
        raise StepOrderError(f"checkpoint asked for step {step}, store is at step {state['applied_step']}")
    final = shard_dir / f"step-{step:010d}"
    tmp = shard_dir / f".tmp-step-{step:010d}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        shard_dir.mkdir(parents=True, exist_ok=True)
        for leftover in shard_dir.iterdir():
            if leftover.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir()
        flat = _flatten(state)
        if rounds is not None:
            flat.update({f"{OUTER_BUF}/{n}": t for n, t in rounds[1].items()})
        sha, nbytes = _write_safetensors(
            tmp / TENSOR_FILE, flat, {"job_id": job_id, "host_id": host_id, "step": str(step)}
        )
        manifest = {
            "format": FORMAT_VERSION,
            "job_id": job_id,
            "host_id": host_id,
            "step": step,
            "names": sorted(state["params"]),
            "state_kinds": sorted(state["state"]),
            "steps": state["steps"],
            "optimizer_config": state["optimizer_config"],
            "tensor_file": TENSOR_FILE,
            "sha256": sha,
            "bytes": nbytes,
            "owner": dict(owner or {}),
        }
        if rounds is not None:
            manifest["rounds"] = {**rounds[0], "outer_buf": sorted(rounds[1])}
        with open(tmp / MANIFEST_FILE, "wb") as f:
            _write_chunk(f, json.dumps(manifest, indent=1, sort_keys=True).encode())
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():
            trash = shard_dir / f".trash-{final.name}-{secrets.token_hex(4)}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(shard_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        code = exc.errno if exc.errno is not None else errno.EIO
        reason = exc.strerror or str(exc)
        raise CheckpointError(
            code, f"checkpoint of {job_id}/{host_id} step {step} failed ({reason}); earlier checkpoints kept"
        ) from exc
    for _, old in _complete_steps(shard_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    logger.info("checkpoint %s written (%d bytes)", final, nbytes)
    return final


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _load_one(
    path: Path, job_id: str, host_id: str, step: int, owner_tag: str | None = None
) -> dict[str, Any]:
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"unknown checkpoint format {manifest.get('format')!r}")
    if (manifest["job_id"], manifest["host_id"], manifest["step"]) != (job_id, host_id, step):
        raise ValueError("manifest does not match its directory")
    if owner_tag is not None and (manifest.get("owner") or {}).get("tag") != owner_tag:
        raise ValueError("the checkpoint belongs to another owner")
    tensor_path = path / manifest["tensor_file"]
    if tensor_path.name != TENSOR_FILE:
        raise ValueError("unexpected tensor file name")
    if _sha256_file(tensor_path) != manifest["sha256"]:
        raise ValueError("tensor file hash mismatch")
    flat = safetensors.torch.load_file(str(tensor_path))
    names = manifest["names"]
    out: dict[str, Any] = {}
    if "rounds" in manifest:
        meta = dict(manifest["rounds"])
        out["rounds"] = (meta, {n: flat[f"{OUTER_BUF}/{n}"] for n in meta.pop("outer_buf")})
    return {
        **out,
        "job_id": job_id,
        "applied_step": step,
        "optimizer_config": manifest["optimizer_config"],
        "params": {n: flat[f"param/{n}"] for n in names},
        "steps": {n: int(manifest["steps"][n]) for n in names},
        "state": {k: {n: flat[f"{k}/{n}"] for n in names} for k in manifest["state_kinds"]},
    }


def shard_steps(dir: Path, job_id: str, host_id: str) -> list[int]:
    """Steps of the complete-looking checkpoints of (job, host) under `dir`, oldest first."""
    return [step for step, _ in _complete_steps(_shard_dir(dir, job_id, host_id))]


def drop_shards_after(dir: Path, job_id: str, host_id: str, step: int) -> list[int]:
    """Removes the checkpoints of (job, host) of steps after `step` (the store went back to `step`:
    they hold steps that were undone, so no restore may read them); returns their steps."""
    dropped = []
    for s, path in _complete_steps(_shard_dir(dir, job_id, host_id)):
        if s > step:
            shutil.rmtree(path, ignore_errors=True)
            dropped.append(s)
    return dropped


def load_shard(
    dir: Path, job_id: str, host_id: str, step: int, owner_tag: str | None = None
) -> dict[str, Any]:
    """The state of the checkpoint of `step` (for ParameterStore.load_state_dict); CheckpointError
    when it is missing, incomplete, corrupt or another owner's."""
    path = _shard_dir(dir, job_id, host_id) / f"step-{step:010d}"
    try:
        return _load_one(path, job_id, host_id, step, owner_tag)
    except (OSError, ValueError, KeyError, TypeError, safetensors.SafetensorError) as exc:
        raise CheckpointError(errno.ENOENT, f"no usable checkpoint of step {step} in {path}: {exc}") from exc


def load_latest_shard(dir: Path, job_id: str, host_id: str) -> tuple[int, dict[str, Any]] | None:
    """(step, state for ParameterStore.load_state_dict) of the newest valid checkpoint, or None."""
    shard_dir = _shard_dir(dir, job_id, host_id)
    for step, path in reversed(_complete_steps(shard_dir)):
        try:
            return step, _load_one(path, job_id, host_id, step)
        except (OSError, ValueError, KeyError, TypeError, safetensors.SafetensorError) as exc:
            logger.warning("skipping checkpoint %s: %s", path, exc)
    return None
