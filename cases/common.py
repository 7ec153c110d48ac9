"""Small helpers shared by case declarations: dtype names, seeded inputs, the model."""

from __future__ import annotations

import functools

import torch

#: Axis values name dtypes by these strings (JSON-able, short in tables).
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def on_cuda(device: str) -> bool:
    return device.startswith("cuda")


def randn(shape, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Seeded standard-normal values (never zeros: they hide unwritten outputs), drawn on
    ``device`` (a GPU draws the gigabytes of a 64K-token cache in milliseconds, a CPU
    generator in seconds), so a seed names the same inputs on the same kind of device."""
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float32, device=device)
    if scale != 1.0:
        t.mul_(scale)
    return t.to(dtype=dtype)


def default_float(device: str) -> str:
    """bf16 on CUDA (the model's dtype); fp16 on CPU, where the Triton interpreter's
    tl.dot on bf16 is broken and fp16 exercises the same low-precision path."""
    return "bf16" if on_cuda(device) else "fp16"


@functools.lru_cache(maxsize=None)
def model(name: str = "kimi-k2.5"):
    from microbench.models import load_model

    return load_model(name)
