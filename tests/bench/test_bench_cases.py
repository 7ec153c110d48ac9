"""Every case point of the device's suite (verify on a GPU, smoke on CPU), every variant."""

from __future__ import annotations

import pytest

from microbench.case import expand, point_label
from microbench.cases import all_cases

from .conftest import DEVICE, SUITE


def _params():
    out = []
    for case in all_cases():
        for point in expand(case.axes(SUITE, DEVICE)):
            if case.skip(point, DEVICE):
                continue
            for v in case.variants():
                if v.runs_on(DEVICE) and not case.skip_variant(v.name, point, DEVICE):
                    out.append(pytest.param(case, point, v.name, id=f"{case.id}[{point_label(point)}]-{v.name}"))
    return out


@pytest.mark.parametrize(("case", "point", "variant"), _params())
def test_case(mb_bench, case, point, variant):
    info = mb_bench(case, point, variant)
    assert info["gate"] in ("ok",) or info["gate"].startswith("not checked")
