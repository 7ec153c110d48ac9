"""Calibration: this device's ceilings, measured in the same run as everything else.

Every table's "% of floor" divides a case's floor time (bytes / bandwidth, FLOPs / matmul
rate) by its measured time; these cases measure the two rates, and the launch floor, on
the device at hand, so the floor is this machine's and not a datasheet's.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from microbench.case import Case, Cost, Point, Variant, Workload
from microbench.cases.common import DTYPES, on_cuda, randn

MiB = 1 << 20


def _copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)


class CopyBandwidth(Case):
    """Device copy ``dst.copy_(src)``: src, dst [n] fp32; bytes = read n*4 + write n*4.

    The buffer is >= 16x the H200's 60 MB L2 on CUDA so the copy streams HBM, not L2.
    """

    id = "calibration.copy"
    title = "device copy bandwidth (bytes read + written)"
    baseline = "torch_copy"
    order = 0
    ceiling = "memory_bandwidth"
    launches_triton = False
    tolerances = {"fp32": (0.0, 0.0)}  # a copy is exact

    def variants(self) -> Sequence[Variant]:
        return [Variant("torch_copy", _copy, doc="torch Tensor.copy_ (cudaMemcpyAsync device to device)")]

    def axes(self, suite: str, device: str = "cuda") -> Mapping[str, Sequence[Any]]:
        if suite not in ("smoke", "verify"):
            return {}
        # CPU: 64 MiB (> any LLC); CUDA: 1 GiB, what the H200 ceilings were read with.
        return {"size_mib": [1024] if on_cuda(device) else [64]}

    def check_axes(self, device: str) -> Mapping[str, Sequence[Any]]:
        return {"size_mib": [1]}  # 64 MiB is far too slow to check under Triton's CPU interpreter

    def setup(self, point: Point, device: str, seed: int) -> Workload:
        n = point["size_mib"] * MiB // 4
        src = randn((n,), torch.float32, device, seed)
        return Workload({"src": src}, {"dst": torch.empty_like(src)}, Cost(bytes=2 * n * 4))

    def reference(self, w: Workload) -> Mapping[str, Any]:
        return {"dst": w.inputs["src"]}


def _matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    torch.matmul(a, b, out=c)


class MatmulRate(Case):
    """Square matmul ``c = a @ b``: a, b, c [n, n]; FLOPs = 2 n^3; bf16 on CUDA, fp32 on CPU."""

    id = "calibration.matmul"
    title = "matmul rate (dense)"
    baseline = "torch_matmul"
    order = 1
    ceiling = "matmul_flops"
    launches_triton = False

    def variants(self) -> Sequence[Variant]:
        return [Variant("torch_matmul", _matmul, doc="torch.matmul (cuBLAS on CUDA, the CPU BLAS otherwise)")]

    def axes(self, suite: str, device: str = "cuda") -> Mapping[str, Sequence[Any]]:
        if suite not in ("smoke", "verify"):
            return {}
        if on_cuda(device):  # 8192^3 bf16: ~790 TFLOP/s measured on an H200 on random data
            return {"n": [8192 if suite == "verify" else 4096], "dtype": ["bf16"]}
        return {"n": [384], "dtype": ["fp32"]}

    def setup(self, point: Point, device: str, seed: int) -> Workload:
        n, dt = point["n"], DTYPES[point["dtype"]]
        a = randn((n, n), dt, device, seed)
        b = randn((n, n), dt, device, seed + 1)
        return Workload({"a": a, "b": b}, {"c": torch.empty(n, n, dtype=dt, device=device)},
                        Cost(bytes=3 * n * n * a.element_size(), flops=2 * n**3))

    def reference(self, w: Workload) -> Mapping[str, Any]:
        a, b = w.inputs["a"], w.inputs["b"]
        return {"c": a.float() @ b.float()}

    def tolerance(self, point: Point) -> tuple[float, float]:
        # Outputs are sums of n products of unit normals: |c| ~ sqrt(n). Rounding the
        # result to bf16 costs 2^-8 of that, so the absolute bound scales with sqrt(n).
        atol, rtol = self.tolerances[point["dtype"]]
        return atol * math.sqrt(point["n"]), rtol


def _triton_empty(x: torch.Tensor) -> None:
    from microbench.kernels.launch import empty_launch

    empty_launch(x)


def _cupy_empty(x: torch.Tensor) -> None:
    from microbench.kernels.launch import cupy_empty_launch

    cupy_empty_launch(x)


def _torch_tiny(x: torch.Tensor) -> None:
    x.add_(0.0)


def _python_noop(x: torch.Tensor) -> None:
    return None


#: capture axis value -> the timing mode it forces
_CAPTURE = {"eager": "hot", "graph": "graph"}


class LaunchFloor(Case):
    """The cost of one launch, back to back: x [1] fp32 (nothing to check: the kernels do
    no work). Four layers of it: a Python call that does nothing (the interpreter), an
    empty CuPy RawKernel (the driver), a one-element torch op (+ the torch dispatcher) and
    an empty Triton kernel (+ Triton's launcher). ``capture=graph`` replays N launches
    from a CUDA graph: what is left is the GPU's own per-kernel floor, and eager minus
    graph is the host's share."""

    id = "calibration.launch"
    title = "launch floor: interpreter, driver, torch, Triton; eager and from a graph"
    baseline = "torch_tiny_op"
    order = 2
    ceiling = "launch_s"

    def variants(self) -> Sequence[Variant]:
        return [
            Variant("python_noop", _python_noop, doc="a Python function call that does nothing: the interpreter"),
            Variant("cupy_empty", _cupy_empty, devices=("cuda",),
                    doc="an empty cupy.RawKernel on torch's stream: the driver's launch path"),
            Variant("torch_tiny_op", _torch_tiny, doc="x.add_(0) on one element: the torch dispatcher + one kernel"),
            Variant("triton_empty", _triton_empty, doc="an empty @triton.jit kernel on one program"),
        ]

    def axes(self, suite: str, device: str = "cuda") -> Mapping[str, Sequence[Any]]:
        if suite not in ("smoke", "verify"):
            return {}
        return {"grid": [1], "capture": list(_CAPTURE) if on_cuda(device) else ["eager"]}

    def point_timing_mode(self, point: Point) -> str | None:
        return _CAPTURE[point.get("capture", "eager")]

    def skip_variant(self, variant: str, point: Point, device: str) -> str | None:
        if variant == "python_noop" and point.get("capture") == "graph":
            return "a Python call puts no work on the GPU: nothing to capture"
        if variant == "cupy_empty":
            from microbench.kernels.launch import cupy_unavailable

            return cupy_unavailable() if on_cuda(device) else "CuPy kernels need a CUDA device"
        return None

    def counts_for_ceiling(self, record: dict[str, Any]) -> bool:
        # the eager launch floor the tables quote is a real kernel's, launched from Python
        return record["variant"] == self.baseline and record["axes"].get("capture", "eager") == "eager"

    def setup(self, point: Point, device: str, seed: int) -> Workload:
        return Workload({"x": randn((1,), torch.float32, device, seed)}, {}, Cost(bytes=0))

    def reference(self, w: Workload) -> Mapping[str, Any]:
        return {}
