"""Every case point of a suite (``--mb-suite``: verify on a GPU, smoke on CPU by default),
every variant."""

from __future__ import annotations

import pytest

from microbench.case import expand, point_label
from microbench.cases import SUITES, all_cases

from .conftest import DEVICE, SUITE


def _params(suite: str):
    out = []
    for case in all_cases():
        for point in expand(case.axes(suite, DEVICE)):
            if case.skip(point, DEVICE):
                continue
            for v in case.variants():
                if v.runs_on(DEVICE) and not case.skip_variant(v.name, point, DEVICE):
                    out.append(pytest.param(case, point, v.name, id=f"{case.id}[{point_label(point)}]-{v.name}"))
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "variant" in metafunc.fixturenames:
        suite = metafunc.config.getoption("--mb-suite") or SUITE
        if suite not in SUITES:
            raise pytest.UsageError(f"--mb-suite {suite!r}: use one of {', '.join(SUITES)}")
        metafunc.parametrize(("case", "point", "variant"), _params(suite))


def test_case(mb_bench, case, point, variant):
    info = mb_bench(case, point, variant)
    assert info["gate"] in ("ok",) or info["gate"].startswith("not checked")
