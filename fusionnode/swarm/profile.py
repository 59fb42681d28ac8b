"""Device profile: what this node computes with, and how fast dense matmuls run on it."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from fusionnode.errors import ConfigError

logger = logging.getLogger(__name__)

PROFILE_FILENAME = "device_profile.json"
DEFAULT_MEASURE_DURATION = 0.5  # seconds of timed matmuls per dtype
DEFAULT_PROFILE_MAX_AGE = 86400.0  # seconds a cached profile stays valid
MIN_MATMUL_N = 128  # side of the first (calibration) square matmul
MAX_MATMUL_N = 8192  # cap on the side of the square matmul
MAX_MATMUL_MEMORY_FRACTION = 0.1  # of free memory the three matrices may use

DEVICE_KINDS = ("cuda", "mps", "cpu")


@dataclass(frozen=True)
class DeviceProfile:
    """Measured device facts. Throughputs in TFLOP/s (1e12 floating-point ops per second); None = not measured."""

    kind: str  # "cuda" | "mps" | "cpu"
    name: str
    memory_total_bytes: int
    memory_free_bytes: int
    tflops_fp32: float
    tflops_bf16: float | None
    tflops_fp16: float | None
    torch_version: str
    cpu_count: int
    measured_at: float  # unix time, seconds

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DeviceProfile:
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            raise ValueError(f"device profile fields {sorted(data)} != {sorted(names)}")
        return cls(**data)


def _pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _memory(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total), int(free)
    vm = psutil.virtual_memory()  # CPU, and MPS (unified memory)
    return int(vm.total), int(vm.available)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple {platform.machine()} (MPS)"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _matmul_tflops(device: torch.device, dtype: torch.dtype, duration_s: float, free_bytes: int) -> float:
    """Time square matmuls of growing size until one takes a tenth of the budget, then fill the budget."""
    elem = torch.tensor([], dtype=dtype).element_size()
    n_cap = MAX_MATMUL_N
    while n_cap > MIN_MATMUL_N and 3 * n_cap * n_cap * elem > MAX_MATMUL_MEMORY_FRACTION * free_bytes:
        n_cap //= 2
    n = MIN_MATMUL_N
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        torch.matmul(a, b)  # warm-up (kernel selection, lazy init)
        _synchronize(device)
        t0 = time.perf_counter()
        torch.matmul(a, b)
        _synchronize(device)
        one = time.perf_counter() - t0
        if one >= duration_s / 10 or n >= n_cap:
            break
        n *= 2
    reps = 0
    t0 = time.perf_counter()
    elapsed = 0.0
    while elapsed < duration_s or reps == 0:
        torch.matmul(a, b)
        reps += 1
        if reps % 4 == 0 or one > duration_s / 20:
            _synchronize(device)
            elapsed = time.perf_counter() - t0
    _synchronize(device)
    elapsed = time.perf_counter() - t0
    return 2.0 * n**3 * reps / elapsed / 1e12


def _try_tflops(device: torch.device, dtype: torch.dtype, duration_s: float, free_bytes: int) -> float | None:
    try:
        return _matmul_tflops(device, dtype, duration_s, free_bytes)
    except (RuntimeError, TypeError) as exc:  # dtype not supported by this device / build
        logger.info("no %s matmul on %s: %s", dtype, device, exc)
        return None


def measure_profile(duration_s: float = DEFAULT_MEASURE_DURATION, device: str | None = None) -> DeviceProfile:
    """Measure dense matmul throughput (fp32; bf16 everywhere it works; fp16 on GPUs) and memory."""
    if duration_s <= 0:
        raise ConfigError(f"duration_s must be > 0, got {duration_s}")
    dev = torch.device(device) if device is not None else _pick_device()
    if dev.type not in DEVICE_KINDS:
        raise ConfigError(f"unsupported device kind {dev.type!r}; expected one of {DEVICE_KINDS}")
    total, free = _memory(dev)
    with torch.no_grad():
        fp32 = _matmul_tflops(dev, torch.float32, duration_s, free)
        bf16 = _try_tflops(dev, torch.bfloat16, duration_s, free)
        # fp16 matmul on CPU is an emulation that nobody would train with; only GPUs report it.
        fp16 = _try_tflops(dev, torch.float16, duration_s, free) if dev.type != "cpu" else None
    total, free = _memory(dev)
    profile = DeviceProfile(
        kind=dev.type,
        name=_device_name(dev)[:128],
        memory_total_bytes=total,
        memory_free_bytes=free,
        tflops_fp32=fp32,
        tflops_bf16=bf16,
        tflops_fp16=fp16,
        torch_version=str(torch.__version__),
        cpu_count=os.cpu_count() or 1,
        measured_at=time.time(),
    )
    logger.info(
        "device profile: %s %s fp32=%.3f bf16=%s fp16=%s TFLOP/s",
        profile.kind,
        profile.name,
        fp32,
        f"{bf16:.3f}" if bf16 is not None else "-",
        f"{fp16:.3f}" if fp16 is not None else "-",
    )
    return profile


def load_or_measure_profile(
    state_dir: Path,
    max_age_s: float = DEFAULT_PROFILE_MAX_AGE,
    force: bool = False,
    duration_s: float = DEFAULT_MEASURE_DURATION,
) -> DeviceProfile:
    """Return the cached profile from ``state_dir`` if fresh and from this torch build; else measure and cache.

    Free memory is always re-read (it changes by the minute); throughputs come from the cache.
    """
    path = Path(state_dir) / PROFILE_FILENAME
    if not force and path.exists():
        try:
            cached = DeviceProfile.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:
            logger.warning("ignoring unreadable device profile cache %s: %s", path, exc)
        else:
            age = time.time() - cached.measured_at
            if 0 <= age <= max_age_s and cached.torch_version == str(torch.__version__):
                dev = torch.device(cached.kind)
                total, free = _memory(dev) if cached.kind != "cuda" or torch.cuda.is_available() else (0, 0)
                if total > 0:
                    return dataclasses.replace(cached, memory_total_bytes=total, memory_free_bytes=free)
    profile = measure_profile(duration_s)
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(profile.to_dict(), indent=1))
    os.replace(tmp, path)
    return profile
