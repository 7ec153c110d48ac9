"""The environment fingerprint and the NVML clock sampler.

On a machine without a GPU the real NVML cannot initialise, so every GPU path is driven
by a fake NVML module (fixed readings, one getter that raises like NVML's "Not
Supported"); the real-module tests check that a missing library degrades to a reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import threading
import time
import types

import numpy as np
import pytest
import torch

from microbench import env

SAMPLER_THREAD = "microbench-clock-sampler"
SW_POWER_CAP, HW_SLOWDOWN, GPU_IDLE = 0x4, 0x8, 0x1  # nvml.h bit values


class FakeNVMLError(Exception):
    pass


class FakeLibraryNotFound(FakeNVMLError):
    pass


class FakeNVML:
    """Implements the NVML calls env.py makes; SM clock and reasons cycle per call."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0
    NVMLError, NVMLError_LibraryNotFound = FakeNVMLError, FakeLibraryNotFound

    def __init__(self, sm_clocks=(1980,), masks=(SW_POWER_CAP | HW_SLOWDOWN,), init_error=None,
                 old_api=False, clock_error=None, uuids=()):
        self.uuids = list(uuids)
        self.sm_clocks, self.masks = list(sm_clocks), list(masks)
        self.init_error, self.clock_error = init_error, clock_error
        self.lock = threading.Lock()
        self.n_sm = self.n_mask = self.n_temp = 0
        self.handles: list[int] = []
        self.thread_sm: list[int] = []  # values returned to the sampler thread
        self.thread_temp: list[int] = []
        name = "nvmlDeviceGetCurrentClocks" + ("ThrottleReasons" if old_api else "EventReasons")
        setattr(self, name, self._reasons)

    def _in_sampler(self) -> bool:
        return threading.current_thread().name == SAMPLER_THREAD

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlSystemGetDriverVersion(self):
        return b"570.124.06"  # older nvidia-ml-py returns bytes

    def nvmlSystemGetCudaDriverVersion(self):
        return 12080

    def nvmlSystemGetNVMLVersion(self):
        return "12.570.124.06"

    def nvmlDeviceGetCount(self):
        return 8

    def nvmlDeviceGetHandleByIndex(self, i):
        self.handles.append(i)
        return ("handle", i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.uuids:
            raise FakeNVMLError("Not Found")
        return ("handle", self.uuids.index(uuid))

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, h):
        return self.uuids[h[1]]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 5

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return 5
    # No link width or persistence getters: fields this nvidia-ml-py "lacks".

    def nvmlDeviceGetClockInfo(self, h, kind):
        if self.clock_error:
            raise FakeNVMLError(self.clock_error)
        if kind != self.NVML_CLOCK_SM:
            return 3201
        with self.lock:
            v = self.sm_clocks[self.n_sm % len(self.sm_clocks)]
            self.n_sm += 1
            if self._in_sampler():
                self.thread_sm.append(v)
        return v

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        return 1980 if kind == self.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetTemperature(self, h, sensor):
        with self.lock:
            v = 40 + self.n_temp % 7  # rises and wraps: the max is not the last reading
            self.n_temp += 1
            if self._in_sampler():
                self.thread_temp.append(v)
        return v

    def nvmlDeviceGetPowerUsage(self, h):
        return 350123  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700000  # mW

    def _reasons(self, h):
        with self.lock:
            v = self.masks[self.n_mask % len(self.masks)]
            self.n_mask += 1
        return v

    def nvmlDeviceGetPerformanceState(self, h):
        raise FakeNVMLError("Not Supported")


def _real_nvml_reason() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return None
    except Exception as e:  # noqa: BLE001
        return "library not found" if type(e).__name__ == "NVMLError_LibraryNotFound" else str(e)


@pytest.mark.parametrize("device", ["cpu", None])
def test_fingerprint_is_json_and_complete(device):
    fp = env.fingerprint(device)
    assert json.loads(json.dumps(fp)) == fp
    assert fp["fingerprint_version"] == env.FINGERPRINT_VERSION
    assert fp["device"]["kind"] == ("cuda" if device is None and torch.cuda.is_available() else "cpu")
    sw = fp["software"]
    assert sw["torch"] == torch.__version__ and sw["numpy"] == np.__version__
    assert re.fullmatch(r"\d+\.\d+.*", sw["triton"]) and re.fullmatch(r"\d+\.\d+\.\d+", sw["python"])
    assert sw["triton_interpret"] == os.environ.get("TRITON_INTERPRET")
    for key in ("tabulate", "nvidia_ml_py", "cupy", "nccl", "platform"):
        assert isinstance(sw[key], str) and sw[key]
    host = fp["host"]
    assert host["hostname"] == socket.gethostname() and host["logical_cpus"] == os.cpu_count()
    assert host["cpu_model"] and host["memory_total_bytes"] is None or host["memory_total_bytes"] > 2**20
    git = fp["git"]
    assert re.fullmatch(r"[0-9a-f]{40}", git["commit"]) if git["commit"] else git["error"]
    nv = fp["nvml"]
    assert isinstance(nv["available"], bool)
    if not nv["available"]:
        assert isinstance(nv["reason"], str) and nv["reason"]


def test_cpu_fingerprint_says_why_cuda_and_nvml_are_absent():
    fp = env.fingerprint("cpu")
    if torch.version.cuda is None:
        assert fp["device"]["cuda"] == "not available (torch built without CUDA)"
        assert fp["software"]["nccl"] == "unavailable: torch built without CUDA"
    elif not torch.cuda.is_available():
        assert fp["device"]["cuda"].startswith("not available (")
    reason = _real_nvml_reason()
    if reason is None:
        pytest.skip("NVML initialises on this machine")
    assert fp["nvml"] == {"available": False, "reason": reason}


def test_cuda_requested_without_cuda_says_why():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    dev = env.fingerprint("cuda:1")["device"]
    assert dev["kind"] == "cuda" and dev["index"] == 1 and dev["cuda"].startswith("not available (")
    assert env.l2_cache_bytes("cuda") is None


def test_nvml_init_failures_become_reasons():
    fp = env.fingerprint("cpu", nvml=FakeNVML(init_error=FakeLibraryNotFound("NVML Shared Library Not Found")))
    assert fp["nvml"] == {"available": False, "reason": "library not found"}
    fp = env.fingerprint("cpu", nvml=FakeNVML(init_error=FakeNVMLError("Driver Not Loaded")))
    assert fp["nvml"] == {"available": False, "reason": "Driver Not Loaded"}


def test_fingerprint_with_fake_nvml_on_cpu():
    nv = env.fingerprint("cpu", nvml=FakeNVML())["nvml"]
    assert nv["available"] is True and nv["driver_version"] == "570.124.06"
    assert nv["cuda_driver_api_version"] == "12.8" and nv["device_count"] == 8
    assert nv["gpu"] == "not sampled (device cpu)"


@pytest.mark.parametrize("old_api", [False, True])
def test_gpu_snapshot_decodes_fake_readings(old_api, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    snap = env.gpu_snapshot(0, nvml=FakeNVML(old_api=old_api))
    assert snap["available"] is True
    assert (snap["sm_clock_mhz"], snap["sm_clock_max_mhz"]) == (1980, 1980)
    assert (snap["mem_clock_mhz"], snap["mem_clock_max_mhz"]) == (3201, 3201)
    assert snap["temperature_c"] == 40
    assert snap["power_w"] == pytest.approx(350.123) and snap["power_limit_w"] == pytest.approx(700.0)
    assert snap["throttle_mask"] == SW_POWER_CAP | HW_SLOWDOWN
    assert snap["throttle_reasons"] == ["hw_slowdown", "sw_power_cap"]
    assert snap["pstate"] == "unavailable: Not Supported"  # the raising getter, nothing else lost
    assert json.dumps(snap)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the handle comes from torch's UUID")
def test_handle_follows_cuda_visible_devices(monkeypatch):
    fake = FakeNVML()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert env.gpu_snapshot(1, nvml=fake)["available"] and fake.handles == [1]
    assert env.gpu_snapshot(0, nvml=fake)["available"] and fake.handles == [1, 3]
    missing = env.gpu_snapshot(2, nvml=fake)
    assert missing["available"] is False and "no handle for device 2" in missing["reason"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0c6d1f3e")
    by_uuid = env.gpu_snapshot(0, nvml=fake)  # the fake knows no UUIDs: a reason, not a crash
    assert by_uuid["available"] is False and "Not Found" in by_uuid["reason"]


def _fake_cuda(monkeypatch, uuid):
    """torch as it is on one H200 whose UUID (as torch gives it, bare) is ``uuid``."""
    props = types.SimpleNamespace(name="NVIDIA H200", uuid=uuid, major=9, minor=0, multi_processor_count=132,
                                  L2_cache_size=60 * 2**20, total_memory=143 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    return props


def test_a_mig_slice_is_found_by_its_uuid_and_read_through_its_gpu(monkeypatch):
    # torch gives the slice's UUID bare; NVML knows it as MIG-...; clocks are the GPU's
    _fake_cuda(monkeypatch, "bbbb")
    fake = FakeNVML(uuids=["GPU-aaaa", "MIG-bbbb"])
    fake.nvmlDeviceGetDeviceHandleFromMigDeviceHandle = lambda h: ("handle", 0)
    fp = env.fingerprint(None, nvml=fake)
    gpu = fp["nvml"]["gpu"]
    assert gpu["handle_by"] == "uuid (a MIG slice: its GPU's)" and gpu["uuid"] == "GPU-aaaa"
    assert gpu["sm_clock_mhz"] == 1980 and fake.handles == []  # never guessed by index


def test_a_gpu_nvml_does_not_know_is_not_read_by_index(monkeypatch):
    # torch's device has a UUID NVML has not: the device at its index is another GPU, so
    # its readings would be that GPU's; a reason instead
    _fake_cuda(monkeypatch, "cccc")
    snap = env.gpu_snapshot(0, nvml=FakeNVML(uuids=["GPU-aaaa"]))
    assert snap["available"] is False
    assert "NVML knows no device with CUDA device 0's UUID (GPU-cccc); its index 0 is GPU-aaaa" in snap["reason"]


def test_a_driver_without_the_clock_event_reasons_call_falls_back_to_the_throttle_one():
    fake = FakeNVML()

    def missing(h):
        raise FakeNVMLError("Function Not Found")

    fake.nvmlDeviceGetCurrentClocksEventReasons = missing
    fake.nvmlDeviceGetCurrentClocksThrottleReasons = fake._reasons
    snap = env.gpu_snapshot(0, nvml=fake)
    assert snap["throttle_reasons"] == ["hw_slowdown", "sw_power_cap"]


def test_cuda_fingerprint_with_faked_device(monkeypatch):
    """The CUDA branch, run here against a faked H200: torch's device properties and NVML."""
    uuid = "0c6d1f3e-1111-2222-3333-444455556666"
    _fake_cuda(monkeypatch, uuid)
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "12.8")
    fp = env.fingerprint(None, nvml=FakeNVML(uuids=["GPU-" + uuid]))
    assert json.loads(json.dumps(fp)) == fp
    dev = fp["device"]
    assert (dev["kind"], dev["index"], dev["cuda"], dev["name"]) == ("cuda", 0, "available", "NVIDIA H200")
    assert (dev["uuid"], dev["compute_capability"], dev["sm_count"]) == ("GPU-" + uuid, "9.0", 132)
    assert (dev["l2_bytes"], dev["total_memory_bytes"]) == (60 * 2**20, 143 * 2**30)
    assert (dev["driver_version"], dev["cuda_driver_api_version"]) == ("570.124.06", "12.8")
    assert dev["cuda_runtime_version"] == torch.version.cuda and env.l2_cache_bytes() == 60 * 2**20
    gpu = fp["nvml"]["gpu"]
    assert gpu["handle_by"] == "uuid" and gpu["sm_clock_mhz"] == 1980 and gpu["pcie_gen_max"] == 5
    assert gpu["throttle_reasons"] == ["hw_slowdown", "sw_power_cap"]
    assert gpu["persistence_mode"].startswith("unavailable: nvmlDeviceGetPersistenceMode not in")
    assert fp["software"]["cupy_cuda_runtime"]  # a version or a reason, never a crash
    text = env.format_fingerprint(fp)
    assert re.search(r"^device:\s+cuda:0 — NVIDIA H200$", text, re.M) and not re.search(r"^(nvml|cuda):", text, re.M)


def test_the_machine_and_the_moment_part_of_a_fingerprint(monkeypatch):
    # pytest-benchmark warns when two runs' machine_info differ: it gets what stays the same
    # on one machine; the readings of the moment and the commit go to each bench's extra_info
    props = _fake_cuda(monkeypatch, "0c6d1f3e-1111-2222-3333-444455556666")
    fp = env.fingerprint(None, nvml=FakeNVML(uuids=["GPU-" + props.uuid]))
    machine, moment = env.split_fingerprint(fp)
    assert "git" not in machine and moment["git"] == fp["git"]
    assert moment["gpu"]["sm_clock_mhz"] == 1980 and "sm_clock_mhz" not in machine["nvml"]["gpu"]
    assert machine["nvml"]["gpu"]["sm_clock_max_mhz"] == fp["nvml"]["gpu"]["sm_clock_max_mhz"]
    assert machine["device"] == fp["device"] and machine["software"] == fp["software"]
    assert fp["nvml"]["gpu"]["sm_clock_mhz"] == 1980  # the fingerprint itself is left whole
    # a second reading at other clocks and temperature: the same machine
    fp2 = env.fingerprint(None, nvml=FakeNVML(sm_clocks=(1500,), masks=(0,), uuids=["GPU-" + props.uuid]))
    assert fp2["nvml"]["gpu"] != fp["nvml"]["gpu"] and env.split_fingerprint(fp2)[0] == machine
    # without a GPU: the machine is the fingerprint less the commit
    cpu, cpu_moment = env.split_fingerprint(env.fingerprint("cpu"))
    assert "git" not in cpu and set(cpu_moment) == {"git"}


def test_decode_throttle_reasons():
    assert env.decode_throttle_reasons(SW_POWER_CAP | HW_SLOWDOWN) == ["hw_slowdown", "sw_power_cap"]
    assert env.decode_throttle_reasons(0) == []
    every = env.decode_throttle_reasons(0x1FF, nvml=object())  # nvml.h values only
    assert every == sorted(["gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
                            "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown",
                            "display_clock_setting"])
    assert env.decode_throttle_reasons(0x10000 | GPU_IDLE, nvml=object()) == ["gpu_idle", "unknown_0x10000"]
    # Bits come from the module when it names them, in either naming generation.
    class New:
        nvmlClocksEventReasonGpuIdle = 0x2000

    class Old:
        nvmlClocksThrottleReasonSwPowerCap = 0x4000

    assert env.decode_throttle_reasons(0x2000, nvml=New) == ["gpu_idle"]
    assert env.decode_throttle_reasons(0x4000, nvml=Old) == ["sw_power_cap"]
    import pynvml

    assert env.decode_throttle_reasons(pynvml.nvmlClocksThrottleReasonSwThermalSlowdown, pynvml) == [
        "sw_thermal_slowdown"]


def _wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.002)


def test_clock_sampler_summarises_changing_clocks(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNVML(sm_clocks=(1980, 1410, 1755), masks=(SW_POWER_CAP, HW_SLOWDOWN | GPU_IDLE, 0))
    with env.ClockSampler(0, interval_s=0.001, nvml=fake) as s:
        _wait_for(lambda: len(fake.thread_sm) >= 6)
    assert not any(t.name == SAMPLER_THREAD for t in threading.enumerate())
    r = s.result()
    assert json.loads(json.dumps(r)) == r and r["available"] is True
    sm = r["sm_clock_mhz"]
    assert sm["n"] == len(fake.thread_sm) >= 6
    assert (sm["min"], sm["max"]) == (1410, 1980)
    assert sm["mean"] == pytest.approx(statistics.mean(fake.thread_sm))
    assert r["temperature_c"]["max"] == max(fake.thread_temp)
    assert r["power_w"]["mean"] == pytest.approx(350.123)
    assert r["throttle_reasons"] == ["gpu_idle", "hw_slowdown", "sw_power_cap"]
    assert r["before"]["available"] and r["after"]["available"] and r["sample_errors"] == 0
    assert r["duration_s"] > 0


def test_clock_sampler_without_nvml_or_device():
    assert env.ClockSampler(0).result() == {"available": False, "reason": "sampler was not started"}
    with env.ClockSampler(None) as s:
        pass
    assert s.result() == {"available": False, "reason": "no CUDA device (CPU run)"}
    with env.ClockSampler(0, nvml=FakeNVML(init_error=FakeNVMLError("Driver Not Loaded"))) as s:
        pass
    assert s.result() == {"available": False, "reason": "nvml: Driver Not Loaded"}
    reason = _real_nvml_reason()
    with env.ClockSampler(0) as s:
        assert not any(t.name == SAMPLER_THREAD for t in threading.enumerate()) or reason is None
    if reason is not None:
        assert s.result() == {"available": False, "reason": f"nvml: {reason}"}


def test_clock_sampler_failing_reads_do_not_crash_the_thread(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args))
    fake = FakeNVML(clock_error="GPU is lost")
    with env.ClockSampler(0, interval_s=0.001, nvml=fake) as s:
        _wait_for(lambda: len(fake.thread_temp) >= 3)
    r = s.result()
    assert raised == [] and r["available"] is True and r["sample_errors"] >= 3
    assert r["sm_clock_mhz"] == {"mean": None, "min": None, "max": None, "n": 0, "reason": "unavailable: GPU is lost"}
    assert r["temperature_c"]["max"] is not None and r["before"]["sm_clock_mhz"] == "unavailable: GPU is lost"


def test_format_fingerprint_names_what_is_missing():
    fp = env.fingerprint("cpu")
    text = env.format_fingerprint(fp)
    assert re.search(rf"^device:\s+cpu — {re.escape(fp['host']['cpu_model'])}$", text, re.M)
    if not fp["nvml"]["available"]:
        assert re.search(rf"^nvml:\s+{re.escape(fp['nvml']['reason'])}$", text, re.M)
    if fp["device"]["cuda"] != "available":
        assert re.search(rf"^cuda:\s+{re.escape(fp['device']['cuda'])}$", text, re.M)
    if fp["software"]["cupy"] == "unavailable: not installed":
        assert re.search(r"^cupy:\s+not installed$", text, re.M)
    assert re.search(rf"^\s+torch:\s+{re.escape(torch.__version__)}$", text, re.M)


def test_format_fingerprint_of_gpu_and_broken_sections():
    fp = {"fingerprint_version": 1,
          "device": {"kind": "cuda", "index": 0, "cuda": "available", "name": "NVIDIA H200"},
          "nvml": {"available": True, "gpu": {"sm_clock_mhz": 1980, "throttle_reasons": []}},
          "software": "unavailable: boom", "git": {"commit": "a" * 40, "short": "a" * 12, "dirty": True}}
    text = env.format_fingerprint(fp)
    assert re.search(r"^device:\s+cuda:0 — NVIDIA H200$", text, re.M)
    assert re.search(r"^profile:\s+h200-sxm \(NVIDIA H200 SXM", text, re.M)  # the % of floor fallback
    assert re.search(r"^git:\s+a{12} \(dirty\)$", text, re.M)
    fp["device"]["name"] = "NVIDIA H100 80GB HBM3"
    assert re.search(r"^profile:\s+h100-sxm \(", env.format_fingerprint(fp), re.M)
    fp["device"]["name"] = "NVIDIA A100-SXM4-80GB"
    assert re.search(r"^profile:\s+none matches this GPU: % of floor comes from the run's measured ceilings alone$",
                     env.format_fingerprint(fp), re.M)
    assert re.search(r"^\s+gpu\.sm_clock_mhz:\s+1980$", text, re.M)
    assert re.search(r"^\s+gpu\.throttle_reasons:\s+none$", text, re.M)
    assert "unavailable: boom" in text and not re.search(r"^(nvml|cuda):", text, re.M)


def test_git_info_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    info = env.git_info(str(tmp_path))
    assert info["commit"] is None and info["error"] in ("not a git checkout", "git not installed")
    assert env.git_info(str(tmp_path / "missing"))["error"].startswith("no such directory")


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_git_info_of_a_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@e", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    assert env.git_info(str(tmp_path))["error"] == "no commits yet"
    (tmp_path / "a.txt").write_text("1")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    (tmp_path / "new.txt").write_text("untracked")
    info = env.git_info(str(tmp_path))
    assert (info["commit"], info["short"], info["dirty"], info["untracked"]) == (sha, sha[:12], False, 1)
    (tmp_path / "a.txt").write_text("2")
    assert env.git_info(str(tmp_path))["dirty"] is True


def test_l2_cache_bytes_cpu():
    size = env.l2_cache_bytes("cpu")
    assert size is None or size >= 64 * 1024
    if os.path.isdir("/sys/devices/system/cpu/cpu0/cache"):
        assert size is not None
    assert env.fingerprint("cpu")["device"]["llc_bytes"] == size
