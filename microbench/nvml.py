"""NVML readings of a CUDA device: one snapshot, and a clock sampler beside each case.

A faster run may have been a different clock state: :func:`gpu_snapshot` reads the clocks,
temperature, power and throttle reasons now; :class:`ClockSampler` records what they did
while a case ran. Nothing here raises for a missing GPU or NVML: a field that cannot be
read holds a string saying why (``"unavailable: <why>"``).

:func:`gpu_snapshot` fields: ``sm_clock_mhz``, ``sm_clock_max_mhz``, ``mem_clock_mhz``,
``mem_clock_max_mhz``, ``temperature_c``, ``power_w``, ``power_limit_w`` (NVML reports
mW), ``throttle_mask``, ``throttle_reasons`` (names), ``pstate`` ("P0").

:meth:`ClockSampler.result` (stored per point as ``clocks``)::

    {"available": bool, "reason": str (when not), "device_index", "interval_s", "duration_s",
     "before": gpu_snapshot(), "after": gpu_snapshot(),
     "sm_clock_mhz": {"mean", "min", "max", "n"}, "temperature_c": {"max"}, "power_w": {"mean"},
     "throttle_reasons": sorted names seen in any sample, "sample_errors": int}

A statistic no sample could read is null (``n`` 0) with ``"reason": "unavailable: <why>"``.

``power_w`` is ``nvmlDeviceGetPowerUsage``, which on Ampere (but GA100) and newer GPUs,
Hopper included, NVML documents as an average over the last second: a point shorter than
that reads partly the one before it. The power limit and the throttle reasons (a power cap
shows there as it happens) are what to read for a short point.

NVML is ``pynvml`` from nvidia-ml-py, imported and initialised lazily once per process
(nvmlInit is reference-counted; it is never shut down). Every NVML-using function takes
``nvml=`` so tests can pass a fake module.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

#: nvml.h bit values, used when the module lacks a constant (older/newer nvidia-ml-py).
_REASON_BITS: dict[str, tuple[str, int | None]] = {
    "gpu_idle": ("GpuIdle", 0x1),
    "applications_clocks_setting": ("ApplicationsClocksSetting", 0x2),
    "sw_power_cap": ("SwPowerCap", 0x4),
    "hw_slowdown": ("HwSlowdown", 0x8),
    "sync_boost": ("SyncBoost", 0x10),
    "sw_thermal_slowdown": ("SwThermalSlowdown", 0x20),
    "hw_thermal_slowdown": ("HwThermalSlowdown", 0x40),
    "hw_power_brake_slowdown": ("HwPowerBrakeSlowdown", 0x80),
    "display_clock_setting": ("DisplayClockSetting", 0x100),
    # Only some nvidia-ml-py versions define these; no fixed bit to fall back on.
    "board_limit": ("BoardLimit", None),
    "reliability": ("Reliability", None),
}

_nvml_lock = threading.Lock()
_nvml_state: dict[int, tuple[Any, str | None]] = {}  # id(module or None) -> (module, reason)


def _why(e: BaseException) -> str:
    s = str(e).strip()
    return s if s else type(e).__name__


def _text(v: Any) -> Any:
    return v.decode(errors="replace") if isinstance(v, bytes) else v


def _nvml(nvml: Any = None) -> tuple[Any, str | None]:
    """(initialised module, None) or (None, reason). Default ``pynvml``, resolved once."""
    key = id(nvml)
    with _nvml_lock:
        if key in _nvml_state:
            mod, reason = _nvml_state[key]
            return (None, reason) if reason else (mod, None)
        mod, reason = nvml, None
        if mod is None:
            try:
                import pynvml as mod  # type: ignore[no-redef]
            except Exception as e:  # noqa: BLE001
                mod, reason = None, f"pynvml not installed (nvidia-ml-py): {_why(e)}"
        if mod is not None and hasattr(mod, "nvmlInit"):
            try:
                mod.nvmlInit()
            except Exception as e:  # noqa: BLE001
                lnf = getattr(mod, "NVMLError_LibraryNotFound", None)
                reason = "library not found" if isinstance(lnf, type) and isinstance(e, lnf) else _why(e)
        # Holding the module keeps its id from being reused by another object.
        _nvml_state[key] = (mod, reason)
        return (None, reason) if reason else (mod, None)


def _get(fn: Callable[..., Any], *args: Any, conv: Callable[[Any], Any] | None = None) -> Any:
    """One NVML (or other) getter: its value, or ``"unavailable: <why>"``."""
    try:
        v = _text(fn(*args))
        return conv(v) if conv else v
    except Exception as e:  # noqa: BLE001 - one missing field must not lose the others
        return f"unavailable: {_why(e)}"


def _call(nvml: Any, name: str, *args: Any, conv: Callable[[Any], Any] | None = None) -> Any:
    fn = getattr(nvml, name, None)
    return _get(fn, *args, conv=conv) if fn else f"unavailable: {name} not in this nvidia-ml-py"

def _reasons_fn(nvml: Any) -> Callable[[Any], int] | None:
    """The clock-event (throttle) reasons getter: ``...ClocksEventReasons`` (drivers from
    R535), falling back to the deprecated ``...ClocksThrottleReasons`` when the driver lacks
    the new symbol (the binding resolves it only when called: an older driver raises
    FunctionNotFound then)."""
    names = [n for n in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
             if getattr(nvml, n, None) is not None]
    if not names:
        return None

    def reasons(h: Any) -> int:
        err: Exception | None = None
        for n in names:
            try:
                return getattr(nvml, n)(h)
            except Exception as e:  # noqa: BLE001 - try the older name
                err = e
        raise err  # type: ignore[misc]

    return reasons


def _no_reasons(_h: Any) -> int:
    raise LookupError("no clock-event reasons in this nvidia-ml-py")


def decode_throttle_reasons(mask: int, nvml: Any = None) -> list[str]:
    """Clock-event (throttle) bitmask -> sorted names; unknown bits as ``unknown_0x...``.

    Bit values come from ``nvml`` (``nvmlClocksEventReason*`` in newer nvidia-ml-py,
    ``nvmlClocksThrottleReason*`` in older), else from nvml.h. No NVML init is needed.
    """
    if nvml is None:
        try:
            import pynvml as nvml  # type: ignore[no-redef]
        except Exception:  # noqa: BLE001 - the nvml.h values below still decode
            nvml = None
    names, seen = [], 0
    for name, (suffix, default) in _REASON_BITS.items():
        bit = getattr(nvml, "nvmlClocksEventReason" + suffix, None)
        if bit is None:
            bit = getattr(nvml, "nvmlClocksThrottleReason" + suffix, default)
        if bit and int(mask) & int(bit):
            names.append(name)
            seen |= int(bit)
    rest = int(mask) & ~seen
    if rest:
        names.append(f"unknown_{rest:#x}")
    return sorted(names)


def _torch_cuda() -> Any:
    """torch when it has a usable CUDA device, else None."""
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        return None


def _nvml_handle(nvml: Any, device_index: int) -> tuple[Any, str]:
    """NVML handle of torch's device ``device_index``: by UUID when torch exposes it (so
    neither CUDA_VISIBLE_DEVICES reordering nor CUDA's fastest-first numbering can pick the
    wrong GPU), else by CUDA_VISIBLE_DEVICES or physical index.

    torch gives the UUID bare; NVML knows a whole GPU as ``GPU-<uuid>`` and a MIG slice as
    ``MIG-<uuid>``: both are tried. A slice's clocks, temperature and power are its GPU's,
    so the handle returned for one is its parent GPU's. When torch has a UUID that NVML
    does not know, a handle found by index must carry that UUID, else LookupError: a
    reading of another GPU is worse than none."""
    torch = _torch_cuda()
    forms: list[str] = []
    if torch is not None:
        try:
            uuid = str(torch.cuda.get_device_properties(device_index).uuid)
            forms = [uuid] if uuid.startswith(("GPU-", "MIG-")) else ["GPU-" + uuid, "MIG-" + uuid]
        except Exception:  # noqa: BLE001 - fall back to the index below
            forms = []
        for form in forms:
            # Older nvidia-ml-py passes the argument to ctypes as is and wants bytes.
            for arg in (form, form.encode()):
                try:
                    h = nvml.nvmlDeviceGetHandleByUUID(arg)
                except Exception:  # noqa: BLE001
                    continue
                if form.startswith("MIG-"):
                    try:
                        return nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h), "uuid (a MIG slice: its GPU's)"
                    except Exception:  # noqa: BLE001 - the slice's own handle, whatever it can read
                        return h, "uuid (a MIG slice)"
                return h, "uuid"
    h, how = _handle_by_index(nvml, device_index)
    if forms:
        try:
            found = _text(nvml.nvmlDeviceGetUUID(h))
        except Exception:  # noqa: BLE001 - nothing to check it against
            return h, how + " (unverified)"
        if found not in forms:
            raise LookupError(f"NVML knows no device with CUDA device {device_index}'s UUID ({forms[0]}); "
                              f"its {how} is {found}")
    return h, how


def _handle_by_index(nvml: Any, device_index: int) -> tuple[Any, str]:
    """NVML handle of torch's device ``device_index`` through CUDA_VISIBLE_DEVICES (an index
    or a UUID there), else NVML's own index."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    phys: int | str = device_index
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if device_index >= len(entries):
            raise LookupError(f"device {device_index} not in CUDA_VISIBLE_DEVICES={visible!r}")
        e = entries[device_index]
        phys = int(e) if e.isdigit() else e
    if isinstance(phys, str):
        return nvml.nvmlDeviceGetHandleByUUID(phys), "uuid (CUDA_VISIBLE_DEVICES)"
    return nvml.nvmlDeviceGetHandleByIndex(phys), f"index {phys}"


def _snapshot_handle(nvml: Any, h: Any) -> dict[str, Any]:
    sm, mem = getattr(nvml, "NVML_CLOCK_SM", 1), getattr(nvml, "NVML_CLOCK_MEM", 2)
    watts = lambda mw: round(mw / 1000.0, 3)  # noqa: E731 - NVML reports milliwatts
    snap: dict[str, Any] = {
        "available": True,
        "sm_clock_mhz": _call(nvml, "nvmlDeviceGetClockInfo", h, sm),
        "sm_clock_max_mhz": _call(nvml, "nvmlDeviceGetMaxClockInfo", h, sm),
        "mem_clock_mhz": _call(nvml, "nvmlDeviceGetClockInfo", h, mem),
        "mem_clock_max_mhz": _call(nvml, "nvmlDeviceGetMaxClockInfo", h, mem),
        "temperature_c": _call(nvml, "nvmlDeviceGetTemperature", h, getattr(nvml, "NVML_TEMPERATURE_GPU", 0)),
        "power_w": _call(nvml, "nvmlDeviceGetPowerUsage", h, conv=watts),
        "power_limit_w": _call(nvml, "nvmlDeviceGetEnforcedPowerLimit", h, conv=watts),
        "pstate": _call(nvml, "nvmlDeviceGetPerformanceState", h, conv=lambda p: f"P{int(p)}"),
    }
    mask = _get(_reasons_fn(nvml) or _no_reasons, h, conv=int)
    snap["throttle_mask"] = mask
    snap["throttle_reasons"] = decode_throttle_reasons(mask, nvml) if isinstance(mask, int) else mask
    return snap


def gpu_snapshot(device_index: int, nvml: Any = None) -> dict[str, Any]:
    """One NVML reading of torch's CUDA device ``device_index`` (clocks in MHz,
    temperature in °C, power in W); ``{"available": False, "reason": ...}`` without NVML."""
    mod, reason = _nvml(nvml)
    if mod is None:
        return {"available": False, "reason": f"nvml: {reason}"}
    try:
        h, _ = _nvml_handle(mod, device_index)
    except Exception as e:  # noqa: BLE001
        return {"available": False, "reason": f"nvml: no handle for device {device_index}: {_why(e)}"}
    return _snapshot_handle(mod, h)


class ClockSampler:
    """Samples SM clock, temperature, power and throttle reasons every ``interval_s``
    in a daemon thread while the ``with`` block runs; :meth:`result` summarises them.

    ``device_index`` is torch's CUDA index; ``None`` (a CPU run) yields an unavailable
    result. A failing read is counted, never raised: the timed code must not notice.
    Each sample costs four NVML calls (tens of µs, outside the GIL); one sampler per
    ``with`` block (create a new one per case).
    """

    def __init__(self, device_index: int | None, interval_s: float = 0.02, nvml: Any = None):
        self.device_index, self.interval_s, self._nvml_arg = device_index, float(interval_s), nvml
        self._mod: Any = None
        self._handle: Any = None
        self._reasons_of: Callable[[Any], int] = _no_reasons  # the reasons getter, chosen once
        self._reason: str | None = "sampler was not started"
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread: threading.Thread | None = None
        self._sm: list[float] = []  # MHz, one per sample; _temp in °C, _power in W
        self._temp: list[float] = []
        self._power: list[float] = []
        self._reasons: set[str] = set()
        self._errors: dict[str, str] = {}  # field -> first error seen
        self._n_errors = 0
        self._before: dict[str, Any] | None = None
        self._after: dict[str, Any] | None = None
        self._t0 = self._t1 = 0.0

    def __enter__(self) -> "ClockSampler":
        self._reason = None
        if self.device_index is None:
            self._reason = "no CUDA device (CPU run)"
            return self
        mod, reason = _nvml(self._nvml_arg)
        if mod is None:
            self._reason = f"nvml: {reason}"
            return self
        try:
            self._handle, _ = _nvml_handle(mod, self.device_index)
        except Exception as e:  # noqa: BLE001
            self._reason = f"nvml: no handle for device {self.device_index}: {_why(e)}"
            return self
        self._mod = mod
        self._reasons_of = _reasons_fn(mod) or _no_reasons
        self._before = _snapshot_handle(mod, self._handle)
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="microbench-clock-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            # A hung NVML call must not hang the run: stop waiting for the thread after ~1 s.
            self._thread.join(timeout=max(1.0, 5 * self.interval_s))
            self._t1 = time.perf_counter()
            self._after = _snapshot_handle(self._mod, self._handle)

    def _loop(self) -> None:
        # One sample at the start and one at the stop, so even a short case has two.
        while True:
            self._sample()
            if self._stop.wait(self.interval_s):
                self._sample()
                return

    def _read(self, field: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            self._n_errors += 1
            self._errors.setdefault(field, _why(e))
            return None

    def _sample(self) -> None:
        m, h = self._mod, self._handle
        sm = self._read("sm_clock_mhz", lambda: m.nvmlDeviceGetClockInfo(h, getattr(m, "NVML_CLOCK_SM", 1)))
        temp = self._read("temperature_c", lambda: m.nvmlDeviceGetTemperature(
            h, getattr(m, "NVML_TEMPERATURE_GPU", 0)))
        power = self._read("power_w", lambda: m.nvmlDeviceGetPowerUsage(h) / 1000.0)
        mask = self._read("throttle_reasons", lambda: int(self._reasons_of(h)))
        names = decode_throttle_reasons(mask, m) if mask is not None else []
        with self._lock:
            for lst, v in ((self._sm, sm), (self._temp, temp), (self._power, power)):
                if v is not None:
                    lst.append(float(v))
            self._reasons.update(names)

    def _stats(self, field: str, values: list[float], keys: tuple[str, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {k: 0 if k == "n" else None for k in keys}
        if values:
            full = {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values)}
            out = {k: full[k] for k in keys}
        elif field in self._errors:
            out["reason"] = f"unavailable: {self._errors[field]}"
        return out

    def result(self) -> dict[str, Any]:
        """Summary (see class doc): clock mean/min/max/n in MHz, max °C, mean W, reasons."""
        if self._reason is not None:
            return {"available": False, "reason": self._reason}
        with self._lock:
            sm, temp, power = list(self._sm), list(self._temp), list(self._power)
            reasons = sorted(self._reasons)
        out = {"available": True, "device_index": self.device_index, "interval_s": self.interval_s,
               "duration_s": (self._t1 or time.perf_counter()) - self._t0,
               "before": self._before, "after": self._after,
               "sm_clock_mhz": self._stats("sm_clock_mhz", sm, ("mean", "min", "max", "n")),
               "temperature_c": self._stats("temperature_c", temp, ("max",)),
               "power_w": self._stats("power_w", power, ("mean",)),
               "throttle_reasons": reasons, "sample_errors": self._n_errors}
        if "throttle_reasons" in self._errors:
            out["throttle_reasons_error"] = f"unavailable: {self._errors['throttle_reasons']}"
        return out
