"""``microbench compile --into-cache`` on a GPU host: a build made through the stand-in
driver (no GPU involved) is the very one a CUDA launch of the same kernel then looks up in
Triton's cache, so the launch loads it instead of compiling (what scripts/gpu-check's
prebuild counts on)."""

from __future__ import annotations

import dataclasses

import pytest
import torch


def _cubins(d):
    return sorted(p.name for p in d.rglob("*.cubin"))


@pytest.mark.gpu
def test_a_build_made_without_the_gpu_is_what_its_first_cuda_launch_loads(tmp_path):
    from triton import knobs

    from microbench.aot import AotError, check_not_interpreted, compile_only
    from microbench.hardware import load_profile
    from tests import aot_kernels

    try:
        check_not_interpreted(aot_kernels._fits)
    except AotError as e:
        pytest.skip(str(e))
    major, minor = torch.cuda.get_device_capability()
    sm = dataclasses.replace(load_profile("h200").sm, compute_capability=f"{major}.{minor}")  # this GPU's arch
    x = torch.randn(4, 7168, dtype=torch.bfloat16)
    with compile_only(sm, cache_dir=str(tmp_path)):
        aot_kernels.fits(x, None, 1e-6, torch.empty_like(x))  # on CPU tensors: compiled, not run
    built = _cubins(tmp_path)
    assert len(built) == 1
    saved = knobs.cache.dir
    try:
        knobs.cache.dir = str(tmp_path)
        xc = x.cuda()
        out = torch.full_like(xc, float("nan"))
        aot_kernels.fits(xc, None, 1e-6, out)  # this kernel's first launch on the GPU in this process
        torch.cuda.synchronize()
    finally:
        knobs.cache.dir = saved
    # a key of its own would have made a second build beside the first
    assert _cubins(tmp_path) == built
    torch.testing.assert_close(out, xc * 2, atol=0, rtol=0)
