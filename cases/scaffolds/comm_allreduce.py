"""A starting point for comm.allreduce: an out-of-place allreduce whose local part is a Triton kernel.

Signature (microbench list --case comm.allreduce): fn(x, group) -> the sum over the group's ranks
  of x [count] (bf16); every rank calls it together. Out of place: x is left as it is and a new
  tensor holding the sum is returned (an in-place path returns x itself, summed).

A Triton kernel cannot reach the other ranks' memory by itself, so this file splits the
allreduce in two: a Triton kernel writes this rank's contribution into a fresh output (here a
plain copy), then torch.distributed.all_reduce sums that output in place across the group.
The kernel is the part to work on: fuse into it what a server does around the allreduce (the
residual add and RMSNorm that follow, a scale, a cast, a quantization before sending), or
pack several small tensors into one buffer so one collective carries them all. The
peer-memory paths (symmetric-memory one-shot / two-shot, where every rank reads its peers'
buffers directly) and NCCL through CuPy live in microbench/kernels/allreduce.py; start from
those to write a kernel that does the reduction itself over mapped peer buffers.

Under `microbench try` the check runs at world size 1 in this process (the sum is x itself);
the inputs are small integers, so the sum must be exact.

Check and time it:   microbench try THIS_FILE::my_allreduce --case comm.allreduce
Iterate on save:     microbench try THIS_FILE::my_allreduce --case comm.allreduce --watch
"""

import torch
import torch.distributed as dist
import triton
import triton.language as tl


@triton.jit
def _my_copy_kernel(x_ptr, out_ptr, count, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < count
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


def my_allreduce(x, group):
    assert x.is_contiguous()
    out = torch.empty_like(x)
    count = x.numel()
    BLOCK = 1024
    _my_copy_kernel[(triton.cdiv(count, BLOCK),)](x, out, count, BLOCK=BLOCK)
    dist.all_reduce(out, group=group)
    return out


# Where the allreduce tables put this variant: its path's row, the out-of-place columns
# (say "in-place" if yours returns x itself).
my_allreduce.tags = {"path": "mine", "placement": "out-of-place"}
