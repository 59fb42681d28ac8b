"""Whether the machine's owner is using it: the owner-activity monitor (CPU, GPU, input idleness).

``ActivityMonitor`` samples CPU (system-wide busy CPU minus the CPU of FusionNode's own process
tree: the daemon, its hivemind DHT child, p2pd, ...), GPU (other processes' utilisation and memory
through NVML, ``pynvml`` when importable) and keyboard/mouse idleness where the platform exposes
it (X11 with libXss, macOS, Windows)."""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil

logger = logging.getLogger(__name__)

DEFAULT_CPU_THRESHOLD = 0.5  # cores: other processes using more than half a core mean the owner is active
DEFAULT_GPU_UTIL_THRESHOLD = 10.0  # percent of the GPU's SMs used by other processes
DEFAULT_GPU_MEMORY_THRESHOLD = 512 * 2**20  # bytes of GPU memory held by other processes
DEFAULT_INPUT_IDLE = 120.0  # seconds: keyboard/mouse input more recent than this means the owner is active

# seconds: psutil's create_time rests on the boot time, which Linux gives in whole seconds, so a
# process born just after a sample can look up to 1 s older than it is
CREATE_TIME_SLACK = 1.5


@dataclasses.dataclass(frozen=True)
class ActivityThresholds:
    cpu_cores: float = DEFAULT_CPU_THRESHOLD  # cores of CPU used by other processes
    gpu_util_percent: float = DEFAULT_GPU_UTIL_THRESHOLD  # percent, other processes on our GPU
    gpu_memory_bytes: int = DEFAULT_GPU_MEMORY_THRESHOLD  # bytes, other processes on our GPU
    input_idle_s: float = DEFAULT_INPUT_IDLE  # seconds since the last keyboard/mouse input


@dataclasses.dataclass(frozen=True)
class ActivitySample:
    at: float  # monotonic seconds when taken
    window_s: float  # seconds the CPU figures average over (since the previous sample)
    own_cpu_cores: float  # FusionNode's process tree
    other_cpu_cores: float | None  # everything else (None when the CPU signal is off)
    other_gpu_util_percent: float | None  # None: no NVML or no GPU
    other_gpu_memory_bytes: int | None
    input_idle_s: float | None  # None: the platform does not tell us
    active: bool  # the owner is using the machine, by the thresholds
    reasons: tuple[str, ...]  # which thresholds were crossed, for logs and status

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def process_tree(root_pid: int) -> list[psutil.Process]:
    """The process and its live descendants (hivemind's DHT child, p2pd, torch_shm_manager ...)."""
    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _busy_cpu_seconds() -> float:
    """System-wide non-idle CPU seconds since boot, summed over cores."""
    t = psutil.cpu_times()
    busy = t.user + t.system
    for field in ("nice", "irq", "softirq"):
        busy += getattr(t, field, 0.0)
    return busy


class _TreeCpu:
    """CPU seconds used by a process tree between two calls, including descendants that exited
    meanwhile and were reaped (they land in their parent's children_* times). A descendant that
    exits without being reaped inside the tree makes one delta too low (clamped at 0)."""

    def __init__(self, root_pid: int):
        self.root_pid = root_pid
        self._last: dict[tuple[int, float], float] = {}  # (pid, create_time) -> cpu seconds seen
        self._last_at = time.time()

    @staticmethod
    def _cpu(p: psutil.Process) -> float:
        c = p.cpu_times()
        return c.user + c.system + c.children_user + c.children_system

    def delta(self) -> float:
        now = time.time()
        seen: dict[tuple[int, float], float] = {}
        used = 0.0
        for p in process_tree(self.root_pid):
            try:
                key = (p.pid, p.create_time())
                cpu = self._cpu(p)
            except psutil.Error:
                continue
            seen[key] = cpu
            if key in self._last:
                used += max(0.0, cpu - self._last[key])
            elif key[1] >= self._last_at - CREATE_TIME_SLACK:
                used += cpu  # born since the last call: all of its time is new
        # a member that exited and was reaped by its parent in the tree shows up again, whole, in the
        # parent's children_* times: take back what we had already counted of it
        used -= sum(cpu for key, cpu in self._last.items() if key not in seen)
        self._last, self._last_at = seen, now
        return max(0.0, used)


class _Nvml:
    """Other processes' use of one NVIDIA GPU through NVML. Written against nvidia-ml-py's API;
    not installed on the CI machine, so this path is untested there. Inside a container NVML may
    report host pids, in which case our own processes are counted as others (pass gpu=False)."""

    def __init__(self, index: int):
        import pynvml  # guarded by the caller

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self._last_ts = 0

    def sample(self, own: set[int]) -> tuple[float, int]:
        nv, h = self.nv, self.handle
        procs = []
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                procs += list(getattr(nv, fn)(h))
            except nv.NVMLError:
                pass
        memory = sum(int(p.usedGpuMemory or 0) for p in procs if p.pid not in own)
        try:
            per_proc = nv.nvmlDeviceGetProcessUtilization(h, self._last_ts)
            self._last_ts = max([self._last_ts, *(s.timeStamp for s in per_proc)])
            util = float(sum(s.smUtil for s in per_proc if s.pid not in own))
        except nv.NVMLError:  # no per-process samples (old driver, or none since last_ts)
            total = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
            util = 0.0 if any(p.pid in own for p in procs) and memory == 0 else total
        return util, memory


def input_idle_seconds() -> float | None:
    """Seconds since the last keyboard/mouse input, or None where the platform does not expose it
    (Linux without an X display, Wayland without XWayland, a headless server)."""
    try:
        if sys.platform == "win32":
            return _input_idle_windows()
        if sys.platform == "darwin":
            return _input_idle_macos()
        if os.environ.get("DISPLAY"):
            return _input_idle_x11()
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        logger.debug("input idleness is not available: %s", exc)
    return None


class _XScreenSaverInfo(ctypes.Structure):
    _fields_ = [
        ("window", ctypes.c_ulong),
        ("state", ctypes.c_int),
        ("kind", ctypes.c_int),
        ("til_or_since", ctypes.c_ulong),
        ("idle", ctypes.c_ulong),
        ("event_mask", ctypes.c_ulong),
    ]


def _input_idle_x11() -> float | None:
    xlib_name, xss_name = ctypes.util.find_library("X11"), ctypes.util.find_library("Xss")
    if not xlib_name or not xss_name:
        return None
    xlib, xss = ctypes.cdll.LoadLibrary(xlib_name), ctypes.cdll.LoadLibrary(xss_name)
    xlib.XOpenDisplay.restype = ctypes.c_void_p
    xlib.XDefaultRootWindow.restype = ctypes.c_ulong
    xlib.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
    xlib.XCloseDisplay.argtypes = [ctypes.c_void_p]
    xss.XScreenSaverAllocInfo.restype = ctypes.POINTER(_XScreenSaverInfo)
    xss.XScreenSaverQueryInfo.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(_XScreenSaverInfo)]
    display = xlib.XOpenDisplay(None)
    if not display:
        return None
    try:
        info = xss.XScreenSaverAllocInfo()
        if not xss.XScreenSaverQueryInfo(display, xlib.XDefaultRootWindow(display), info):
            return None
        idle_ms = info.contents.idle
        xlib.XFree(info)
        return idle_ms / 1000.0
    finally:
        xlib.XCloseDisplay(display)


def _input_idle_macos() -> float | None:
    out = subprocess.run(
        ["ioreg", "-c", "IOHIDSystem", "-d", "4"], capture_output=True, text=True, timeout=2, check=False
    ).stdout
    m = re.search(r'"HIDIdleTime"\s*=\s*(\d+)', out)
    return int(m.group(1)) / 1e9 if m else None


def _input_idle_windows() -> float | None:
    class LASTINPUTINFO(ctypes.Structure):
        _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]

    info = LASTINPUTINFO(ctypes.sizeof(LASTINPUTINFO), 0)
    if not ctypes.windll.user32.GetLastInputInfo(ctypes.byref(info)):  # type: ignore[attr-defined]
        return None
    ticks = ctypes.windll.kernel32.GetTickCount() & 0xFFFFFFFF  # type: ignore[attr-defined]
    return ((ticks - info.dwTime) & 0xFFFFFFFF) / 1000.0


class ActivityMonitor:
    """Samples how much the machine's owner uses it, excluding FusionNode's own processes.

    ``sample()`` does not block: CPU figures are averages since the previous call (the first call
    only primes the counters). ``own_root_pid`` is the daemon (default: this process); its whole
    live tree is "own". ``scope_root_pid`` restricts "others" to one process tree (for example a
    user's desktop session) instead of the whole machine; tests use it to be immune to other load.
    ``cpu`` defaults to on for CPU-only peers; ``gpu_index`` (an NVIDIA device index) turns on NVML.
    """

    def __init__(
        self,
        thresholds: ActivityThresholds = ActivityThresholds(),
        *,
        own_root_pid: int | None = None,
        scope_root_pid: int | None = None,
        cpu: bool = True,
        gpu_index: int | None = None,
        watch_input: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.thresholds = thresholds
        self.own_root_pid = os.getpid() if own_root_pid is None else own_root_pid
        self.scope_root_pid = scope_root_pid
        self.cpu = cpu
        self.watch_input = watch_input
        self.clock = clock
        self._own = _TreeCpu(self.own_root_pid)
        self._scope = _TreeCpu(scope_root_pid) if scope_root_pid is not None else None
        self._busy = _busy_cpu_seconds()
        self._at = clock()
        self._own.delta()
        if self._scope is not None:
            self._scope.delta()
        self._nvml: _Nvml | None = None
        if gpu_index is not None:
            try:
                self._nvml = _Nvml(gpu_index)
            except ImportError:
                logger.warning("GPU activity is not watched: install nvidia-ml-py (module pynvml)")
            except Exception as exc:  # NVMLError has no common importable base without pynvml
                logger.warning("GPU activity is not watched: NVML failed (%s)", exc)

    @property
    def signals(self) -> tuple[str, ...]:
        """The signals this monitor actually reads here."""
        out = ["cpu"] if self.cpu else []
        if self._nvml is not None:
            out.append("gpu")
        if self.watch_input:
            out.append("input")
        return tuple(out)

    def sample(self) -> ActivitySample:
        now = self.clock()
        window = max(now - self._at, 1e-6)
        own_s = self._own.delta()
        if self._scope is not None:
            total_s = self._scope.delta()
        else:
            busy = _busy_cpu_seconds()
            total_s, self._busy = busy - self._busy, busy
        self._at = now
        own_cores = own_s / window
        other_cores = max(0.0, total_s - own_s) / window if self.cpu else None
        gpu_util = gpu_mem = None
        if self._nvml is not None:
            own_pids = {p.pid for p in process_tree(self.own_root_pid)}
            try:
                gpu_util, gpu_mem = self._nvml.sample(own_pids)
            except Exception as exc:  # a transient NVML error must not stop the monitor
                logger.warning("NVML sample failed: %s", exc)
        idle = input_idle_seconds() if self.watch_input else None
        th, reasons = self.thresholds, []
        if other_cores is not None and other_cores > th.cpu_cores:
            reasons.append(f"other processes use {other_cores:.2f} cores")
        if gpu_util is not None and gpu_util > th.gpu_util_percent:
            reasons.append(f"other processes use {gpu_util:.0f}% of the GPU")
        if gpu_mem is not None and gpu_mem > th.gpu_memory_bytes:
            reasons.append(f"other processes hold {gpu_mem / 2**20:.0f} MiB of GPU memory")
        if idle is not None and idle < th.input_idle_s:
            reasons.append(f"keyboard/mouse used {idle:.0f} s ago")
        return ActivitySample(
            at=now,
            window_s=window,
            own_cpu_cores=own_cores,
            other_cpu_cores=other_cores,
            other_gpu_util_percent=gpu_util,
            other_gpu_memory_bytes=gpu_mem,
            input_idle_s=idle,
            active=bool(reasons),
            reasons=tuple(reasons),
        )


def build_monitor(
    device_kind: str,
    thresholds: ActivityThresholds = ActivityThresholds(),
    *,
    gpu_index: int = 0,
    own_root_pid: int | None = None,
) -> ActivityMonitor:
    """The monitor for a peer's device: CPU load on CPU-only peers, NVML on CUDA peers (falling back
    to CPU load when NVML is missing), input idleness everywhere it exists."""
    if device_kind == "cuda":
        monitor = ActivityMonitor(thresholds, own_root_pid=own_root_pid, cpu=False, gpu_index=gpu_index)
        if monitor._nvml is not None:
            return monitor
    return ActivityMonitor(thresholds, own_root_pid=own_root_pid, cpu=True)
