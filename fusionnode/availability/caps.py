"""How much of the machine a contributing peer takes: --max-util, --max-memory, freeing memory.

``--max-util`` sets torch threads (and a duty cycle on CUDA), ``--max-memory`` caps the CUDA
allocator, and cached accelerator memory is handed back to the owner when the peer pauses."""

from __future__ import annotations

import gc
import logging
import math
import os
import re
from typing import Any

from fusionnode.errors import ConfigError

logger = logging.getLogger(__name__)

_PERCENT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%?\s*$")


def parse_percent(text: str | float) -> float:
    """'80%' or '80' -> 80.0; must lie in (0, 100]."""
    m = _PERCENT_RE.match(str(text))
    if not m:
        raise ConfigError(f"cannot read {text!r} as a percentage (example: 80%)")
    value = float(m.group(1))
    if not 0 < value <= 100:
        raise ConfigError(f"percentage {text!r} must be in (0, 100]")
    return value


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def apply_util_cap(percent: float | str, requested_threads: int | None = None) -> dict[str, Any]:
    """``--max-util``: caps this process's compute at about ``percent`` of the device.

    CPU: torch intra-op threads = max(1, floor(usable cores x percent/100)), or ``requested_threads``
    (``--threads``) when that is fewer: a cap never raises the thread count.
    CUDA: there is no per-process SM cap in torch. If CUDA is not initialised yet, sets
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (honoured only when an MPS daemon runs); the portable cap is a
    duty cycle: the worker sleeps ``throttle_delay(compute_s, percent)`` after each compute.
    """
    import torch

    percent = parse_percent(percent)
    cores = usable_cores()
    threads = max(1, math.floor(cores * percent / 100))
    if requested_threads is not None:
        threads = max(1, min(threads, requested_threads))
    torch.set_num_threads(threads)
    out: dict[str, Any] = {
        "percent": percent,
        "cores": cores,
        "torch_threads": threads,
        "duty_cycle": percent / 100,
    }
    if torch.cuda.is_available():
        if not torch.cuda.is_initialized():
            os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, round(percent)))
            out["cuda_mps_active_thread_percentage"] = max(1, round(percent))
        out["cuda"] = "duty cycle (throttle_delay); MPS thread percentage if an MPS daemon runs"
    logger.info("utilisation cap: %s", out)
    return out


def throttle_delay(compute_s: float, percent: float) -> float:
    """Seconds to idle after ``compute_s`` seconds of work so that busy time is ``percent`` of the total."""
    if percent >= 100 or compute_s <= 0:
        return 0.0
    return compute_s * (100.0 / percent - 1.0)


def apply_memory_cap(max_bytes: int) -> dict[str, Any]:
    """``--max-memory`` on CUDA: torch's caching allocator refuses to grow past it in this process.
    On CPU nothing is enforced (an RLIMIT_AS would break torch and p2pd); the planner respects the
    advertised capacity instead."""
    import torch

    out: dict[str, Any] = {"max_bytes": int(max_bytes), "enforced": False}
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        fraction = min(1.0, max_bytes / total)
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
        out.update(enforced=True, fraction=fraction)
    return out


def free_accelerator_memory() -> dict[str, Any]:
    """After the worker dropped its stages: collect garbage and hand cached CUDA blocks back to the
    driver so the owner can use them. Returns reserved bytes before and after (0 on CPU)."""
    import torch

    gc.collect()
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {"device": "cpu", "reserved_before": 0, "reserved_after": 0}
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return {"device": "cuda", "reserved_before": before, "reserved_after": torch.cuda.memory_reserved()}
