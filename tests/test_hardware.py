"""Hardware profiles: the shipped ones load with a source for every figure, a GPU's name
picks its profile, and a malformed profile is refused with a message naming the figure."""

from __future__ import annotations

import json

import pytest

import microbench.hardware as hardware_mod
from microbench.hardware import (
    Figure,
    HardwareProfile,
    list_profiles,
    load_profile,
    profile_for_device_name,
)
from microbench.models import ConfigError

from .helpers import shipped_json


@pytest.mark.parametrize("name", ["h100-pcie", "h100-sxm", "h200-sxm", "rtx-pro-6000-blackwell"])
def test_profiles_load_with_sources(name: str) -> None:
    p = load_profile(name)
    assert isinstance(p, HardwareProfile) and p.name == name and p.match
    figures = p.figures()
    for key in ("memory_bandwidth", "bf16_dense_flops", "fp8_dense_flops", "l2_bytes", "sm_count",
                "memory_bytes", "launch_overhead", "interconnect.bandwidth_per_direction", "interconnect.latency"):
        assert isinstance(figures[key], Figure), key
    for key, fig in figures.items():
        assert fig.value > 0 and fig.source.strip(), key


def test_profile_figures() -> None:
    h200, rtx = load_profile("h200-sxm"), load_profile("rtx-pro-6000-blackwell")
    assert h200.memory_bandwidth.value == 4.8e12 and h200.memory_bandwidth.unit == "B/s"
    assert h200.bf16_dense_flops.value == 989e12 and h200.sm_count.value == 132
    assert h200.l2_bytes.value == 62914560 and h200.interconnect["kind"] == "nvlink"
    assert h200.interconnect["bandwidth_per_direction"].value == 450e9
    assert h200.measured["copy_bandwidth"].value == 4.3e12
    assert rtx.interconnect["kind"] == "pcie" and rtx.sm_count.value == 188
    assert rtx.peak_flops("fp8").value == 1007.6e12 and rtx.peak_flops("int4") is rtx.bf16_dense_flops
    assert list_profiles() == ["h100-pcie", "h100-sxm", "h200-sxm", "rtx-pro-6000-blackwell"]
    h100 = load_profile("h100")  # the same SM as the H200's, less and slower memory, a smaller L2
    assert h100.name == "h100-sxm" and h100.aliases == ("h100",)
    assert h100.sm == h200.sm and h100.sm_count.value == h200.sm_count.value
    assert h100.memory_bandwidth.value == 3.35e12 and h100.l2_bytes.value == 50 * 2**20
    assert h100.memory_bytes.value == 80e9 and h100.measured == {}
    pcie = load_profile("h100-pcie")  # the same die cut to 114 SMs, HBM2e, no NVLink across 8 GPUs
    assert pcie.sm == h100.sm and pcie.sm_count.value == 114 and pcie.l2_bytes.value == h100.l2_bytes.value
    assert pcie.memory_bandwidth.value == 2.0e12 and pcie.bf16_dense_flops.value == 756.5e12
    assert pcie.peak_flops("fp8").value == 1513e12 and pcie.interconnect["kind"] == "pcie"


@pytest.mark.parametrize("key, name", [("h100", "h100-sxm"), ("h200", "h200-sxm"), ("h100-p", "h100-pcie"),
                                       ("h100-s", "h100-sxm"), ("rtx-pro-6000", "rtx-pro-6000-blackwell")])
def test_profile_by_alias_or_unique_prefix(key: str, name: str) -> None:
    assert load_profile(key).name == name


@pytest.mark.parametrize("key, names", [("h1", "h100-pcie, h100-sxm"), ("h", "h100-pcie, h100-sxm, h200-sxm")])
def test_ambiguous_profile_prefix_lists_the_candidates(key: str, names: str) -> None:
    with pytest.raises(ConfigError, match=rf"hardware profile '{key}' is ambiguous: {names} all begin with it"):
        load_profile(key)


def test_profile_alias_must_name_one_profile(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "hardware"
    folder.mkdir()
    for name, aliases in [("h200-sxm", ["h200"]), ("h200-nvl", ["h200"])]:
        raw = shipped_json("hardware", "h200-sxm")
        raw.update(name=name, aliases=aliases)
        (folder / f"{name}.json").write_text(json.dumps(raw))
    monkeypatch.setattr(hardware_mod, "_shipped", lambda kind: {p.stem: str(p) for p in sorted(folder.glob("*.json"))})
    with pytest.raises(ConfigError, match=r"hardware profiles h200-nvl and h200-sxm both answer to 'h200'"):
        load_profile("h200")
    raw["aliases"] = ["h200-sxm"]  # an alias may not shadow another profile's name either
    (folder / "h200-nvl.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"hardware profiles h200-sxm and h200-nvl both answer to 'h200-sxm'"):
        load_profile("h200-nvl")
    raw["aliases"] = []
    (folder / "h200-nvl.json").write_text(json.dumps(raw))
    assert load_profile("h200").name == "h200-sxm" and load_profile("h200-n").name == "h200-nvl"


def test_profile_for_device_name() -> None:
    assert profile_for_device_name("NVIDIA H200").name == "h200-sxm"
    assert profile_for_device_name("NVIDIA H100 80GB HBM3").name == "h100-sxm"  # torch's name for the SXM part
    assert profile_for_device_name("NVIDIA H100 PCIe").name == "h100-pcie"  # 2 TB/s HBM2e: not the SXM figures
    assert profile_for_device_name("NVIDIA H100 NVL") is None  # a third H100 part: no shipped figures
    assert profile_for_device_name("NVIDIA RTX PRO 6000 Blackwell Server Edition").name == "rtx-pro-6000-blackwell"
    assert profile_for_device_name("NVIDIA A100-SXM4-80GB") is None
    # whole words: a Grace Hopper's GH200 (96 GB HBM3 at ~4 TB/s) is not an H200; other boards
    # of one chip are taken out by the profile's exclude list
    assert profile_for_device_name("NVIDIA GH200 480GB") is None
    assert profile_for_device_name("NVIDIA H200 NVL") is None
    assert profile_for_device_name("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition") is None
    assert profile_for_device_name("NVIDIA RTX PRO 6000 Blackwell Workstation Edition").name == "rtx-pro-6000-blackwell"


def _write(tmp_path, data: dict):
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_profile_missing_figure_named(tmp_path) -> None:
    raw = shipped_json("hardware", "h200-sxm")
    del raw["figures"]["memory_bandwidth"]
    with pytest.raises(ConfigError, match=r"edited\.json: missing figure 'memory_bandwidth'"):
        load_profile(_write(tmp_path, raw))
    raw = shipped_json("hardware", "h200-sxm")
    del raw["interconnect"]["latency"]
    with pytest.raises(ConfigError, match=r"missing figure 'interconnect\.latency'"):
        load_profile(_write(tmp_path, raw))


def test_profile_optional_figure_may_be_absent(tmp_path) -> None:
    raw = shipped_json("hardware", "h200-sxm")
    del raw["figures"]["fp8_dense_flops"]
    assert load_profile(_write(tmp_path, raw)).fp8_dense_flops is None


@pytest.mark.parametrize("edit, pattern", [
    (lambda r: r["figures"]["memory_bandwidth"].update(unit="GB/s"), r"'memory_bandwidth' unit must be B/s"),
    (lambda r: r["figures"]["sm_count"].update(source=" "), r"'sm_count' needs a non-empty source"),
    (lambda r: r["figures"]["l2_bytes"].update(value=-1), r"'l2_bytes' value must be a positive number"),
    (lambda r: r["figures"].update(hbm_bw={}), r"unknown figure 'hbm_bw'"),
    (lambda r: r["interconnect"].update(kind="infiniband"), r"interconnect kind must be one of"),
    (lambda r: r.update(match=[]), r"'match' must be a non-empty list"),
    (lambda r: r.update(exclude="NVL"), r"'exclude' must be a list of device-name words"),
    (lambda r: r.update(aliases="h200"), r"'aliases' must be a list of short lowercase names"),
    (lambda r: r.update(aliases=["H200"]), r"'aliases' must be a list of short lowercase names"),
])
def test_profile_bad_values_named(tmp_path, edit, pattern: str) -> None:
    raw = shipped_json("hardware", "h200-sxm")
    edit(raw)
    with pytest.raises(ConfigError, match=pattern):
        load_profile(_write(tmp_path, raw))


def test_unknown_profile_lists_shipped_names() -> None:
    with pytest.raises(ConfigError, match=r"unknown hardware profile 'tpu'; shipped profiles: h100-pcie, "
                       r"h100-sxm \(alias h100\), h200-sxm \(alias h200\), rtx-pro-6000-blackwell \(or pass"):
        load_profile("tpu")
