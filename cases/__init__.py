"""Case declarations and the suites they form.

Importing this package imports no kernel: kernels are imported when a variant first runs,
after the harness has chosen the device (and, on CPU, switched Triton to its interpreter).
"""

from __future__ import annotations

from microbench.case import Case

#: Suite name -> what it is for (printed by ``microbench list``).
SUITES: dict[str, str] = {
    "smoke": "every case but selftest.cpu_work at small shapes: the main job on a machine without a GPU "
             "(CPU/interpreter timings)",
    "verify": "Kimi-K2.5 at TP8 shapes: the verify step's components on a GPU",
    "selftest": "the harness's own check: the same CPU work and 10% more of it must read SLOWER",
}


def all_cases() -> list[Case]:
    """Every shipped case, calibration first."""
    from microbench.cases.calibration import CopyBandwidth, LaunchFloor, MatmulRate
    from microbench.cases.comm import AllReduceCase, AllReduceSweepCase
    from microbench.cases.layer import DecoderLayerCase
    from microbench.cases.mla import MLAVerifyCase
    from microbench.cases.moe import MoEAlignCase, MoEExpertsCase, MoERouterCase
    from microbench.cases.rmsnorm import RMSNormCase
    from microbench.cases.selftest import CpuWork

    cases: list[Case] = [CopyBandwidth(), MatmulRate(), LaunchFloor(), RMSNormCase(), MLAVerifyCase(),
                         MoERouterCase(), MoEAlignCase(), MoEExpertsCase(), AllReduceCase(), AllReduceSweepCase(),
                         DecoderLayerCase(),                          CpuWork()]
    return sorted(cases, key=lambda c: (c.order, c.id))


def get_case(case_id: str) -> Case:
    for c in all_cases():
        if c.id == case_id:
            return c
    known = ", ".join(c.id for c in all_cases())
    raise KeyError(f"unknown case {case_id!r} (cases: {known})")
