"""When this peer contributes: yield the device to its owner, keep to a schedule, obey pause/resume.

Four parts, from pure to I/O:

- ``Schedule``: local-time windows ("22:00-07:00,12:00-13:00"; a window may cross midnight), and the
  start of the next window (advertised as ``next_window`` while paused by the schedule).
- ``observe`` / ``pause_manual`` / ``resume_manual``: a pure state machine over
  ``AvailabilityState``. Causes of a pause, by precedence: manual > schedule > owner. Hysteresis on
  the owner: pause after ``confirm_samples`` consecutive active samples (default 2, i.e. within
  about 2 check intervals); resume only after ``grace_s`` seconds with no active sample.
- ``ActivityMonitor``: samples the owner's use of the machine. CPU: system-wide busy CPU minus the
  CPU of FusionNode's own process tree (the daemon, its hivemind DHT child, p2pd, ...). GPU: other
  processes' utilisation and memory through NVML (``pynvml``, when importable). Keyboard/mouse
  idleness where the platform exposes it (X11 with libXss, macOS, Windows); skipped otherwise.
- ``AvailabilityController``: the async runner. Samples every ``interval_s``, feeds the state
  machine, and calls ``on_change(availability, next_window)`` whenever what this peer should
  advertise changes ("available"/"paused", ISO start of the next schedule window or None).

Also ``apply_util_cap`` (``--max-util``), ``apply_memory_cap`` and ``free_accelerator_memory``,
which the node calls when it starts and when it pauses.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import dataclasses
import datetime as dt
import gc
import logging
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal

import psutil

from fusionnode.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_CHECK_INTERVAL = 2.0  # seconds between two samples of owner activity
DEFAULT_GRACE = 60.0  # seconds the owner must stay idle before this peer contributes again
DEFAULT_CONFIRM_SAMPLES = 2  # consecutive "owner active" samples before pausing (one spike is not use)
DEFAULT_CPU_THRESHOLD = 0.5  # cores: other processes using more than half a core mean the owner is active
DEFAULT_GPU_UTIL_THRESHOLD = 10.0  # percent of the GPU's SMs used by other processes
DEFAULT_GPU_MEMORY_THRESHOLD = 512 * 2**20  # bytes of GPU memory held by other processes
DEFAULT_INPUT_IDLE = 120.0  # seconds: keyboard/mouse input more recent than this means the owner is active

# seconds: psutil's create_time rests on the boot time, which Linux gives in whole seconds, so a
# process born just after a sample can look up to 1 s older than it is
CREATE_TIME_SLACK = 1.5

WHEN = ("idle", "always")
REASONS = ("owner", "schedule", "manual")  # causes of a pause, lowest to highest precedence
Availability = Literal["available", "paused"]


# ---- schedule --------------------------------------------------------------------------------------
_WINDOW_RE = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")
MINUTES_PER_DAY = 24 * 60


@dataclasses.dataclass(frozen=True)
class Window:
    """One local-time window [start, end) in minutes after midnight; end <= start crosses midnight."""

    start_min: int
    end_min: int

    def contains(self, minute: int) -> bool:
        if self.start_min < self.end_min:
            return self.start_min <= minute < self.end_min
        return minute >= self.start_min or minute < self.end_min  # crosses midnight

    def __str__(self) -> str:
        def hm(m: int) -> str:
            return f"{m // 60:02d}:{m % 60:02d}"

        return f"{hm(self.start_min)}-{hm(self.end_min)}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Local-time windows in which this peer may contribute. Parse with ``Schedule.parse``."""

    windows: tuple[Window, ...]

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """'22:00-07:00' or '22:00-07:00,12:00-13:30'; '24:00' is allowed as an end; start == end is refused."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError("--schedule is empty; expected windows like 22:00-07:00[,12:00-13:00]")
        windows = []
        for part in text.split(","):
            m = _WINDOW_RE.match(part)
            if not m:
                raise ConfigError(f"cannot read schedule window {part.strip()!r}; expected HH:MM-HH:MM")
            sh, sm, eh, em = (int(g) for g in m.groups())
            if sh > 23 or sm > 59 or em > 59 or eh > 24 or (eh == 24 and em != 0):
                raise ConfigError(f"schedule window {part.strip()!r} has an impossible time of day")
            start, end = sh * 60 + sm, eh * 60 + em
            if start == end % MINUTES_PER_DAY and end != MINUTES_PER_DAY:
                raise ConfigError(
                    f"schedule window {part.strip()!r} starts where it ends; for all day write 00:00-24:00"
                )
            windows.append(Window(start, end % MINUTES_PER_DAY if end != MINUTES_PER_DAY else 0))
        return cls(tuple(windows))

    def contains(self, when: dt.datetime) -> bool:
        minute = when.hour * 60 + when.minute
        return any(w.contains(minute) for w in self.windows)

    def next_start(self, when: dt.datetime) -> dt.datetime:
        """The first window start strictly after ``when`` (same tzinfo as ``when``)."""
        base = when.replace(second=0, microsecond=0)
        best: dt.datetime | None = None
        for w in self.windows:
            cand = base.replace(hour=w.start_min // 60, minute=w.start_min % 60)
            if cand <= when:
                cand += dt.timedelta(days=1)
            if best is None or cand < best:
                best = cand
        assert best is not None  # parse() never yields an empty schedule
        return best

    def __str__(self) -> str:
        return ",".join(str(w) for w in self.windows)


# ---- pure state machine ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AvailabilityPolicy:
    when: str = "idle"  # "idle": yield to the owner; "always": ignore owner activity
    grace_s: float = DEFAULT_GRACE  # seconds idle before resuming after the owner was active
    confirm_samples: int = DEFAULT_CONFIRM_SAMPLES  # consecutive active samples before pausing

    def __post_init__(self) -> None:
        if self.when not in WHEN:
            raise ConfigError(f"--when must be one of {', '.join(WHEN)}, got {self.when!r}")
        if self.grace_s < 0:
            raise ConfigError("grace must be >= 0 seconds")
        if self.confirm_samples < 1:
            raise ConfigError("confirm_samples must be >= 1")


@dataclasses.dataclass(frozen=True)
class AvailabilityState:
    manual: bool = False  # paused by hand until resume
    outside_schedule: bool = False  # the last check found local time outside every window
    owner_paused: bool = False  # the owner-activity latch (set after confirm, cleared after grace)
    active_streak: int = 0  # consecutive samples with the owner active
    idle_since: float | None = None  # monotonic seconds: first idle sample while owner_paused

    @property
    def reason(self) -> str | None:
        """Why we are paused (the highest-precedence cause), or None when available."""
        if self.manual:
            return "manual"
        if self.outside_schedule:
            return "schedule"
        if self.owner_paused:
            return "owner"
        return None

    @property
    def availability(self) -> Availability:
        return "available" if self.reason is None else "paused"


def observe(
    state: AvailabilityState,
    policy: AvailabilityPolicy,
    *,
    now: float,
    owner_active: bool | None,
    in_schedule: bool = True,
) -> AvailabilityState:
    """One check: ``now`` in monotonic seconds; ``owner_active`` None when not measured (when=always)."""
    outside = not in_schedule
    if policy.when == "always" or owner_active is None:
        return dataclasses.replace(
            state, outside_schedule=outside, owner_paused=False, active_streak=0, idle_since=None
        )
    if owner_active:
        streak = state.active_streak + 1
        return dataclasses.replace(
            state,
            outside_schedule=outside,
            active_streak=streak,
            owner_paused=state.owner_paused or streak >= policy.confirm_samples,
            idle_since=None,
        )
    owner_paused, idle_since = state.owner_paused, state.idle_since
    if owner_paused:
        idle_since = now if idle_since is None else idle_since
        if now - idle_since >= policy.grace_s:
            owner_paused, idle_since = False, None
    return dataclasses.replace(
        state, outside_schedule=outside, active_streak=0, owner_paused=owner_paused, idle_since=idle_since
    )


def pause_manual(state: AvailabilityState) -> AvailabilityState:
    return dataclasses.replace(state, manual=True)


def resume_manual(state: AvailabilityState) -> AvailabilityState:
    """Lifts a manual pause only; a schedule or owner pause in force stays."""
    return dataclasses.replace(state, manual=False)


def advertisement(
    state: AvailabilityState, schedule: Schedule | None, now_local: dt.datetime
) -> tuple[Availability, str | None]:
    """(availability, next_window) for the peer record: next_window is the ISO start of the next
    schedule window while paused by the schedule, else None."""
    if state.reason == "schedule" and schedule is not None:
        return "paused", schedule.next_start(now_local).isoformat(timespec="minutes")
    return state.availability, None


# ---- owner-activity monitor ------------------------------------------------------------------------
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


# ---- async runner ----------------------------------------------------------------------------------
OnChange = Callable[[str, "str | None"], Awaitable[None]]


class AvailabilityController:
    """Runs the state machine on a timer and tells the node what to advertise.

    ``monitor`` None means ``--when always`` (only the schedule and manual pauses apply).
    ``on_change(availability, next_window)`` runs once per change of what we advertise, never
    concurrently with itself; if it raises, it is logged and retried at the next check.
    """

    def __init__(
        self,
        monitor: ActivityMonitor | None,
        schedule: Schedule | None,
        on_change: OnChange,
        *,
        policy: AvailabilityPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        local_now: Callable[[], dt.datetime] = lambda: dt.datetime.now().astimezone(),
        interval_s: float = DEFAULT_CHECK_INTERVAL,
    ):
        if interval_s <= 0:
            raise ConfigError("the activity check interval must be > 0 seconds")
        self.monitor = monitor
        self.schedule = schedule
        self.on_change = on_change
        self.policy = policy or AvailabilityPolicy(when="idle" if monitor is not None else "always")
        self.clock = clock
        self.local_now = local_now
        self.interval_s = interval_s
        self._state = AvailabilityState()
        self._published: tuple[str, str | None] = ("available", None)
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self.last_sample: ActivitySample | None = None
        self.changed_at: float | None = None  # monotonic seconds of the last on_change that succeeded

    @property
    def state(self) -> AvailabilityState:
        return self._state

    def status(self) -> dict[str, Any]:
        s = self._state
        return {
            "availability": s.availability,
            "reason": s.reason,
            "when": self.policy.when,
            "schedule": str(self.schedule) if self.schedule else None,
            "next_window": self._published[1],
            "signals": list(self.monitor.signals) if self.monitor else [],
            "last_sample": self.last_sample.to_dict() if self.last_sample else None,
        }

    async def check(self) -> None:
        """One tick: sample, update the state, publish if the advertisement changed."""
        sample = None
        if self.monitor is not None and self.policy.when == "idle":
            sample = await asyncio.to_thread(self.monitor.sample)
            self.last_sample = sample
        now_local = self.local_now()
        in_schedule = self.schedule.contains(now_local) if self.schedule else True
        before = self._state.reason
        self._state = observe(
            self._state,
            self.policy,
            now=self.clock(),
            owner_active=None if sample is None else sample.active,
            in_schedule=in_schedule,
        )
        if self._state.reason != before:
            why = "; ".join(sample.reasons) if sample is not None and sample.reasons else ""
            logger.info("availability: %s (%s) %s", self._state.availability, self._state.reason, why)
        await self._publish()

    async def _publish(self) -> None:
        async with self._lock:
            ad = advertisement(self._state, self.schedule, self.local_now())
            if ad == self._published:
                return
            try:
                await self.on_change(*ad)
            except Exception:
                logger.exception("on_change%s failed; will retry at the next check", ad)
                return
            self._published = ad
            self.changed_at = self.clock()

    async def run(self) -> None:
        """Checks every interval_s until cancelled (primes the monitor's counters first)."""
        if self.monitor is not None:
            await asyncio.to_thread(self.monitor.sample)
        while True:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
            await self.check()

    async def pause(self, reason: str = "manual") -> dict[str, Any]:
        """Pause by hand until resume(); returns status() once on_change has run."""
        if reason != "manual":
            raise ConfigError(f"only a manual pause can be requested, not {reason!r}")
        self._state = pause_manual(self._state)
        await self._publish()
        return self.status()

    async def resume(self) -> dict[str, Any]:
        """Lifts a manual pause; a schedule or owner pause still in force keeps us paused."""
        self._state = resume_manual(self._state)
        await self._publish()
        return self.status()


# ---- caps and freeing ------------------------------------------------------------------------------
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


def describe(policy: AvailabilityPolicy, schedule: Schedule | None, signals: Iterable[str]) -> str:
    """One log line at startup."""
    return (
        f"contributing when={policy.when} schedule={schedule or 'any time'} "
        f"signals={','.join(signals) or '-'} grace={policy.grace_s:g}s confirm={policy.confirm_samples}"
    )
