"""Small helpers shared by case declarations: dtype names, seeded inputs, the model."""

from __future__ import annotations

import functools
import math

import torch

#: Axis values name dtypes by these strings (JSON-able, short in tables).
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def on_cuda(device: str) -> bool:
    return device.startswith("cuda")


#: From this many elements a tensor is a weight or a cache. While launches only compile
#: (``microbench compile``) nothing reads its values, so it is allocated, not drawn:
#: drawing a 384-expert layer on a CPU takes tens of seconds. Smaller tensors (hidden
#: states, routing, lengths) are still drawn, since host-side launch logic reads them.
UNDRAWN_NUMEL = 1 << 22


def undrawn(shape, dtype: torch.dtype, device: str) -> torch.Tensor | None:
    """An uninitialised tensor in place of a large draw while launches only compile; else None."""
    from microbench.kernels import checks

    if checks.COMPILE_ONLY and math.prod(shape) >= UNDRAWN_NUMEL:
        return torch.empty(shape, dtype=dtype, device=device)
    return None


def randn(shape, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Seeded standard-normal values (never zeros: they hide unwritten outputs), drawn on
    ``device`` (a GPU draws the gigabytes of a 64K-token cache in milliseconds, a CPU
    generator in seconds), so a seed names the same inputs on the same kind of device."""
    skipped = undrawn(shape, dtype, device)
    if skipped is not None:
        return skipped
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float32, device=device)
    if scale != 1.0:
        t.mul_(scale)
    return t.to(dtype=dtype)


def default_float(device: str) -> str:
    """bf16 on CUDA (the model's dtype); fp16 on CPU, where the Triton interpreter's
    own tl.dot on bf16 is broken (the tests check bf16 with a patched one,
    tests/interp_bf16.py) and fp16 exercises the same low-precision path."""
    return "bf16" if on_cuda(device) else "fp16"


@functools.lru_cache(maxsize=None)
def model(name: str = "kimi-k2.5"):
    from microbench.models import load_model

    return load_model(name)
