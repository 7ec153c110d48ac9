"""The environment fingerprint stored in every result file, and clock sampling per case.

A number without its environment is a rumour: a faster run last week may have been a
different clock state, driver or commit. :func:`fingerprint` records what can change a
result; :class:`ClockSampler` (from :mod:`microbench.nvml`, re-exported here) records what the
GPU clocks did while a case ran.

Nothing here raises for a missing GPU, NVML, CUDA or CuPy: a field that cannot be read
holds a string saying why (``"unavailable: <why>"``, or ``"not available (...)"`` for
CUDA). Fingerprint schema (``FINGERPRINT_VERSION = 1``; every value JSON-serialisable)::

    {"fingerprint_version": 1,
     "device": {"kind": "cuda" | "cpu", "requested": the argument (null = default),
                "cuda": "available" | "not available (<why>)",
                # cuda:  "index", "name", "uuid", "compute_capability" ("9.0"), "sm_count",
                #        "l2_bytes", "total_memory_bytes", "visible_devices",
                #        "cuda_visible_devices", "cuda_runtime_version" (torch.version.cuda),
                #        "driver_version", "cuda_driver_api_version" ("12.8", from NVML)
                # cpu:   "name" (CPU model), "llc_bytes" (last-level cache)
               },
     "nvml": {"available": bool, "reason": str (when not), "nvml_version", "driver_version",
              "cuda_driver_api_version", "device_count",
              "gpu": {...gpu_snapshot() fields..., "name", "uuid", "handle_by",
                      "pcie_gen_current", "pcie_gen_max", "pcie_width_current",
                      "pcie_width_max", "persistence_mode"}
                     | "not sampled (device cpu)"},
     "software": {"python", "torch", "torch_cuda", "torch_git", "triton", "numpy", "cupy",
                  "cupy_cuda_runtime", "nccl", "tabulate", "nvidia_ml_py", "platform",
                  "triton_interpret" (value of TRITON_INTERPRET, null when unset)},
     "git": git_info() of the checkout holding this package,
     "host": {"hostname", "cpu_model", "logical_cpus", "usable_cpus",
              "memory_total_bytes", "os", "distro", "machine"}}

A section that could not be built at all is the string ``"unavailable: <why>"``.

NVML access (lazy initialisation, :func:`gpu_snapshot` fields, the ``ClockSampler.result``
schema) is documented in :mod:`microbench.nvml`; :func:`fingerprint` takes the same
``nvml=`` argument so tests can pass a fake module.
"""

from __future__ import annotations

import importlib.metadata as _md
import os
import platform
import socket
import subprocess
from typing import Any, Callable

from microbench.nvml import ClockSampler, decode_throttle_reasons, gpu_snapshot  # noqa: F401  (re-exported)
from microbench.nvml import _call, _get, _nvml, _nvml_handle, _snapshot_handle, _torch_cuda, _why

FINGERPRINT_VERSION = 1

_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _version_text(v: int) -> str:
    """CUDA's integer version (12080) as "12.8"."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def _parse_device(device: Any) -> tuple[str, int | None, str | None]:
    """(kind, index, reason CUDA cannot be used or None)."""
    torch = _torch_cuda()
    dev = ("cuda:0" if torch is not None else "cpu") if device is None else str(device)
    if not dev.startswith("cuda"):
        return dev, None, None
    idx_text = dev.partition(":")[2]
    if torch is None:
        return "cuda", int(idx_text) if idx_text.isdigit() else 0, _cuda_reason()
    idx = int(idx_text) if idx_text.isdigit() else torch.cuda.current_device()
    n = torch.cuda.device_count()
    if idx >= n:
        return "cuda", idx, f"not available (device index {idx} out of range, {n} visible)"
    return "cuda", idx, None


def _cuda_reason() -> str:
    """Why torch cannot use CUDA here, or "available"."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return f"not available (torch not importable: {_why(e)})"
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return "not available (torch built without CUDA)"
    try:
        if torch.cuda.is_available():
            return "available"
    except Exception as e:  # noqa: BLE001
        return f"not available ({_why(e)})"
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "not available (no CUDA device visible" + (f"; CUDA_VISIBLE_DEVICES={vis!r})" if vis is not None else ")")


def _cpu_llc_bytes() -> int | None:
    """Size of the highest-level data/unified cache of CPU 0 from sysfs (e.g. "32768K")."""
    base, best = "/sys/devices/system/cpu/cpu0/cache", (0, None)
    try:
        entries = sorted(e for e in os.listdir(base) if e.startswith("index"))
    except OSError:
        return None
    for e in entries:
        level, kind, size = (_read_first(f"{base}/{e}/{f}") for f in ("level", "type", "size"))
        size = (size or "").upper()
        digits, mult = size.rstrip("KMG"), {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        if kind != "Instruction" and (level or "").isdigit() and digits.isdigit() and int(level) >= best[0]:
            best = (int(level), int(digits) * mult)
    return best[1]


def l2_cache_bytes(device: str | None = None) -> int | None:
    """Bytes of the cache a cold-cache flush must overwrite: the GPU's L2 on CUDA, the
    last-level cache of CPU 0 on CPU; ``None`` when unknown."""
    try:
        kind, idx, reason = _parse_device(device)
        if kind == "cuda":
            if reason:
                return None
            import torch

            return int(torch.cuda.get_device_properties(idx).L2_cache_size) or None
        return _cpu_llc_bytes()
    except Exception:  # noqa: BLE001 - unknown is a valid answer
        return None


def _git(cwd: str, *args: str) -> subprocess.CompletedProcess:
    # GIT_OPTIONAL_LOCKS=0: `git status` must not write the index of the checkout it reads.
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}
    return subprocess.run(["git", "-C", cwd, *args], capture_output=True, text=True, timeout=10, env=env)


def git_info(repo_dir: str | None = None) -> dict[str, Any]:
    """Commit of the checkout at ``repo_dir`` (default: the one holding this package).

    ``{"commit", "short", "dirty", "untracked", "branch"}``; ``dirty`` counts changes to
    tracked files only (result files written into the checkout must not make every run
    dirty), ``untracked`` the untracked entries. On failure ``commit`` is None and
    ``error`` says why ("not a git checkout", "no commits yet", "git not installed").
    """
    d = os.path.abspath(repo_dir or _PROJECT_ROOT)
    out: dict[str, Any] = {"commit": None, "short": None, "dirty": None}
    try:
        if not os.path.isdir(d):
            return {**out, "error": f"no such directory: {d}"}
        top = _git(d, "rev-parse", "--show-toplevel")
        if top.returncode != 0:
            err = top.stderr.strip()
            return {**out, "error": "not a git checkout" if "not a git repository" in err else err or "git failed"}
        # An installed copy inside some other repository (a venv in a checkout) is not that repository's code.
        if repo_dir is None and os.path.realpath(top.stdout.strip()) != os.path.realpath(d):
            return {**out, "error": "not a git checkout"}
        status = _git(d, "status", "--porcelain")
        if status.returncode == 0:
            lines = [ln for ln in status.stdout.splitlines() if ln.strip()]
            out["dirty"] = any(not ln.startswith("??") for ln in lines)
            out["untracked"] = sum(ln.startswith("??") for ln in lines)
        branch = _git(d, "symbolic-ref", "--short", "-q", "HEAD")
        out["branch"] = branch.stdout.strip() or None if branch.returncode == 0 else None
        head = _git(d, "rev-parse", "--verify", "-q", "HEAD")
        if head.returncode != 0:
            return {**out, "error": "no commits yet"}
        sha = head.stdout.strip()
        return {**out, "commit": sha, "short": sha[:12]}
    except FileNotFoundError:
        return {**out, "error": "git not installed"}
    except Exception as e:  # noqa: BLE001
        return {**out, "error": _why(e)}


def _dist_version(*names: str) -> str:
    for n in names:
        try:
            return _md.version(n)
        except Exception:  # noqa: BLE001
            continue
    return "unavailable: not installed"


def _read_first(path: str, key: str | None = None) -> str | None:
    """The whole (stripped) file, or the value of the first ``key: v`` / ``key=v`` line."""
    try:
        with open(path) as f:
            if key is None:
                return f.read().strip()
            for line in f:
                k, sep, v = line.partition(":" if ":" in line else "=")
                if sep and k.strip() == key:
                    return v.strip().strip('"')
    except OSError:
        pass
    return None


def usable_cpus() -> int | None:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def _host_section() -> dict[str, Any]:
    mem = _read_first("/proc/meminfo", "MemTotal")
    usable = usable_cpus()
    return {"hostname": socket.gethostname(),
            "cpu_model": _read_first("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
            "logical_cpus": os.cpu_count(), "usable_cpus": usable,
            "memory_total_bytes": int(mem.split()[0]) * 1024 if mem and mem.split()[0].isdigit() else None,
            "os": f"{platform.system()} {platform.release()}",
            "distro": _read_first("/etc/os-release", "PRETTY_NAME"), "machine": platform.machine()}


def _software_section(cuda_ok: bool) -> dict[str, Any]:
    sw: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        sw["torch"], sw["torch_cuda"] = torch.__version__, torch.version.cuda or "none (built without CUDA)"
        sw["torch_git"] = getattr(torch.version, "git_version", None)
        if getattr(torch.version, "hip", None):
            sw["torch_hip"] = torch.version.hip
        if torch.version.cuda is None:
            sw["nccl"] = "unavailable: torch built without CUDA"
        else:
            v = _get(torch.cuda.nccl.version)
            sw["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001
        sw["torch"] = f"unavailable: {_why(e)}"
    # Metadata, not import: importing triton here could fix its mode before TRITON_INTERPRET is set.
    sw["triton"] = _dist_version("triton", "pytorch-triton", "triton-nightly")
    sw["numpy"], sw["tabulate"] = _dist_version("numpy"), _dist_version("tabulate")
    sw["nvidia_ml_py"] = _dist_version("nvidia-ml-py", "pynvml")
    try:
        import cupy

        sw["cupy"] = cupy.__version__
        # CuPy imports without a GPU and fails at first device use: ask only when CUDA works.
        sw["cupy_cuda_runtime"] = (_get(cupy.cuda.runtime.runtimeGetVersion, conv=_version_text) if cuda_ok
                                   else "unavailable: no CUDA device")
    except ImportError:
        sw["cupy"] = sw["cupy_cuda_runtime"] = "unavailable: not installed"
    except Exception as e:  # noqa: BLE001
        sw["cupy"] = sw["cupy_cuda_runtime"] = f"unavailable: import failed: {_why(e)}"
    sw["triton_interpret"] = os.environ.get("TRITON_INTERPRET")
    return sw


def _nvml_section(kind: str, idx: int | None, usable: bool, mod: Any, reason: str | None) -> dict[str, Any]:
    if mod is None:
        return {"available": False, "reason": reason}
    nv: dict[str, Any] = {"available": True,
                          "nvml_version": _call(mod, "nvmlSystemGetNVMLVersion"),
                          "driver_version": _call(mod, "nvmlSystemGetDriverVersion"),
                          "cuda_driver_api_version": _call(mod, "nvmlSystemGetCudaDriverVersion", conv=_version_text),
                          "device_count": _call(mod, "nvmlDeviceGetCount")}
    if kind != "cuda" or idx is None or not usable:
        nv["gpu"] = f"not sampled (device {kind})"
        return nv
    try:
        h, how = _nvml_handle(mod, idx)
    except Exception as e:  # noqa: BLE001
        nv["gpu"] = f"unavailable: no handle for device {idx}: {_why(e)}"
        return nv
    gpu = {"handle_by": how, "name": _call(mod, "nvmlDeviceGetName", h), "uuid": _call(mod, "nvmlDeviceGetUUID", h),
           **_snapshot_handle(mod, h)}
    for key, fn in (("pcie_gen_current", "CurrPcieLinkGeneration"), ("pcie_gen_max", "MaxPcieLinkGeneration"),
                    ("pcie_width_current", "CurrPcieLinkWidth"), ("pcie_width_max", "MaxPcieLinkWidth")):
        gpu[key] = _call(mod, "nvmlDeviceGet" + fn, h)
    gpu["persistence_mode"] = _call(mod, "nvmlDeviceGetPersistenceMode", h,
                                    conv=lambda v: "enabled" if int(v) else "disabled")
    nv["gpu"] = gpu
    return nv


def _device_section(kind: str, idx: int | None, reason: str | None, requested: Any, nv: dict) -> dict[str, Any]:
    dev: dict[str, Any] = {"kind": kind, "requested": None if requested is None else str(requested)}
    if kind != "cuda":
        dev.update(cuda=_cuda_reason(), name=_host_section()["cpu_model"], llc_bytes=l2_cache_bytes("cpu"))
        return dev
    dev.update(index=idx, cuda=reason or "available")
    if reason:
        return dev
    import torch

    p = torch.cuda.get_device_properties(idx)
    gpu = nv.get("gpu") if isinstance(nv.get("gpu"), dict) else {}
    uuid = gpu.get("uuid")
    if not isinstance(uuid, str) or uuid.startswith("unavailable"):
        uuid = _get(lambda: str(p.uuid), conv=lambda u: u if u.startswith(("GPU-", "MIG-")) else "GPU-" + u)
    no_nvml = f"unavailable: nvml {nv.get('reason')}"
    dev.update(name=p.name, uuid=uuid, compute_capability=f"{p.major}.{p.minor}",
               sm_count=p.multi_processor_count, l2_bytes=_get(lambda: int(p.L2_cache_size)),
               total_memory_bytes=int(p.total_memory), visible_devices=torch.cuda.device_count(),
               cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
               cuda_runtime_version=torch.version.cuda or getattr(torch.version, "hip", None),
               driver_version=nv.get("driver_version", no_nvml),
               cuda_driver_api_version=nv.get("cuda_driver_api_version", no_nvml))
    return dev


def _section(build: Callable[[], Any]) -> Any:
    try:
        return build()
    except Exception as e:  # noqa: BLE001 - the fingerprint never raises
        return f"unavailable: {_why(e)}"


def fingerprint(device: str | None = None, *, nvml: Any = None) -> dict[str, Any]:
    """The environment of a run on ``device`` ("cuda", "cuda:N", "cpu"; None = cuda:0
    when available, else cpu); schema in the module docstring. Never raises."""
    try:
        kind, idx, reason = _parse_device(device)
    except Exception as e:  # noqa: BLE001
        kind, idx, reason = str(device), None, f"not available ({_why(e)})"
    mod, nv_reason = _nvml(nvml)
    nv = _section(lambda: _nvml_section(kind, idx, reason is None, mod, nv_reason))
    nv_dict = nv if isinstance(nv, dict) else {"reason": nv}
    return {"fingerprint_version": FINGERPRINT_VERSION,
            "device": _section(lambda: _device_section(kind, idx, reason, device, nv_dict)),
            "nvml": nv,
            "software": _section(lambda: _software_section(kind == "cuda" and reason is None)),
            "git": _section(git_info), "host": _section(_host_section)}


#: NVML readings of the moment (``nvml.gpu``), which differ between any two runs on one machine
LIVE_GPU_FIELDS = ("sm_clock_mhz", "mem_clock_mhz", "temperature_c", "power_w", "pstate", "throttle_mask",
                   "throttle_reasons", "pcie_gen_current", "pcie_width_current")


def split_fingerprint(fp: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(machine, moment)``: what stays the same between runs on one machine and software
    (the device, the NVML static fields, the software, the host), and what does not (the
    NVML readings of the moment, the checkout's commit). pytest-benchmark warns when two
    runs' machine_info differ, so it gets the first alone."""
    machine = {k: v for k, v in fp.items() if k != "git"}
    gpu = (fp.get("nvml") or {}).get("gpu") if isinstance(fp.get("nvml"), dict) else None
    moment: dict[str, Any] = {"git": fp.get("git")}
    if isinstance(gpu, dict):
        machine["nvml"] = {**fp["nvml"], "gpu": {k: v for k, v in gpu.items() if k not in LIVE_GPU_FIELDS}}
        moment["gpu"] = {k: gpu[k] for k in LIVE_GPU_FIELDS if k in gpu}
    return machine, moment


def _flat(d: Any, prefix: str = "") -> list[tuple[str, str]]:
    if not isinstance(d, dict):
        return [(prefix or "value", _fmt(d))]
    rows: list[tuple[str, str]] = []
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        rows.extend(_flat(v, key) if isinstance(v, dict) else [(key, _fmt(v))])
    return rows


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v)) or "none"
    return str(v)


def _missing(v: Any) -> str | None:
    """The reason text of an unavailable field, else None."""
    if isinstance(v, str) and v.startswith(("unavailable: ", "not available")):
        return v.removeprefix("unavailable: ")
    return None


def format_fingerprint(fp: dict[str, Any]) -> str:
    """Text for ``microbench env``: a summary (device, commit, and one line per missing
    piece, e.g. ``nvml: library not found``), then every field as aligned ``key: value``."""
    dev, sw, git = (fp.get(k) if isinstance(fp.get(k), dict) else {} for k in ("device", "software", "git"))
    nv = fp.get("nvml") if isinstance(fp.get("nvml"), dict) else {"available": False, "reason": fp.get("nvml")}
    summary = [("device", f"{dev.get('kind', '?')}"
                + (f":{dev['index']}" if dev.get("index") is not None else "") + f" — {dev.get('name', '?')}"),
               ("git", f"{git.get('short')}{' (dirty)' if git.get('dirty') else ''}" if git.get("commit")
                else f"none ({git.get('error', 'unknown')})")]
    if dev.get("cuda") != "available":
        summary.append(("cuda", str(dev.get("cuda", "unknown"))))
    elif isinstance(dev.get("name"), str):
        summary.append(("profile", _profile_text(dev["name"])))
    if not nv.get("available"):
        summary.append(("nvml", str(nv.get("reason"))))
    for key in ("cupy", "nccl"):
        if _missing(sw.get(key)):
            summary.append((key, _missing(sw.get(key))))
    blocks = [_aligned(summary)]
    for name, sec in fp.items():
        if name != "fingerprint_version":
            blocks.append(f"[{name}]\n" + _aligned(_flat(sec), indent="  "))
    return "\n\n".join(blocks)


def _profile_text(gpu: str) -> str:
    """Which shipped hardware profile a GPU's tables fall back to for "% of floor" (the
    run's own measured ceilings come first)."""
    from microbench.hardware import profile_for_device_name

    try:
        prof = profile_for_device_name(gpu)
    except Exception as e:  # noqa: BLE001 - a broken profile file must not break the fingerprint
        return f"unavailable: {_why(e)}"
    if prof is None:
        return "none matches this GPU: % of floor comes from the run's measured ceilings alone"
    return f"{prof.name} ({prof.description})"


def _aligned(rows: list[tuple[str, str]], indent: str = "") -> str:
    w = max((len(k) for k, _ in rows), default=0) + 1
    return "\n".join(f"{indent}{k + ':':<{w}} {v}" for k, v in rows)
