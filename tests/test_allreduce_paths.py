"""The allreduce paths on CPU: inputs whose sums are exact in any order, and what each
path does with its buffers, in place (the input is the result) or out of place (a fresh
output, the input left as it was), with stand-ins for the collective, NCCL through CuPy
and the symmetric-memory kernels."""

from __future__ import annotations

import pytest
import torch

from microbench.kernels.allreduce import allreduce_ref, rank_input, value_range


@pytest.mark.parametrize("world", [1, 2, 3, 8, 32, 100])  # 32, 100: bf16 sums of rank + 1 alone pass 256
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_integer_inputs_give_an_exact_sum_in_any_order(world, dtype):
    count = 1001  # odd
    xs = [rank_input(count, r, world, 5, dtype, "cpu") for r in range(world)]
    assert all(bool((x != 0).any()) for x in xs) and all(x.dtype == dtype for x in xs)
    assert all(float(x.float().abs().max()) <= value_range(world, dtype) for x in xs)
    want = allreduce_ref(count, world, 5, dtype, "cpu")
    forward, backward = torch.zeros(count, dtype=dtype), torch.zeros(count, dtype=dtype)
    for x in xs:  # the partial sums stay exact in the low-precision dtype, in either order
        forward += x
    for x in reversed(xs):
        backward += x
    assert torch.equal(forward.float(), want) and torch.equal(backward.float(), want)
    # another seed, other inputs; the same seed, the same inputs
    assert not torch.equal(rank_input(count, 0, world, 6, dtype, "cpu"), xs[0])
    assert torch.equal(rank_input(count, 0, world, 5, dtype, "cpu"), xs[0])


def test_every_rank_draws_its_own_input_never_all_zero_even_of_one_element():
    for world in (2, 8):
        xs = [rank_input(64, r, world, 5, torch.bfloat16, "cpu") for r in range(world)]
        assert all(not torch.equal(xs[i], xs[j]) for i in range(world) for j in range(i))
        assert all(rank_input(1, r, world, 5, torch.bfloat16, "cpu").item() != 0 for r in range(world))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_value_range_is_the_largest_whose_sum_over_every_rank_stays_exact(dtype):
    from microbench.kernels.allreduce import EXACT_LIMIT, VALUE_RANGE

    limit = EXACT_LIMIT[dtype]
    for world in range(1, 600):
        v = value_range(world, dtype)
        assert world * v <= limit and (v == VALUE_RANGE or world * (v + 1) > limit), world


def test_torch_paths_sum_in_place_or_into_a_fresh_output(monkeypatch):
    """A stand-in collective doubles its tensor, as a sum over two ranks holding the same
    input would: in place the input is the result; out of place it is left as it was."""
    from microbench.kernels import allreduce

    groups = []
    monkeypatch.setattr(allreduce.dist, "all_reduce", lambda t, group=None: groups.append(group) or t.mul_(2))
    x = torch.tensor([1.0, 2.0, 3.0])
    assert allreduce.torch_inplace(x, "g") is x and x.tolist() == [2.0, 4.0, 6.0]
    x = torch.tensor([1.0, 2.0, 3.0])
    out = allreduce.torch_outplace(x, "g")
    assert out.tolist() == [2.0, 4.0, 6.0] and x.tolist() == [1.0, 2.0, 3.0] and out.data_ptr() != x.data_ptr()
    assert groups == ["g", "g"]


def test_cupy_paths_hand_nccl_one_buffer_in_place_and_a_fresh_one_out_of_place(monkeypatch):
    """What the CuPy communicator is handed: send and receive pointers, the element count,
    NCCL's dtype (nccl.h's value where CuPy lacks the name), its sum and torch's stream."""
    import types

    from microbench.kernels import allreduce

    calls = []

    class Comm:
        def allReduce(self, *args):
            calls.append(args)

    group = object()
    c = object.__new__(allreduce.CupyNccl)
    c.nccl, c.comm = types.SimpleNamespace(), Comm()  # a CuPy build without the constants' names
    monkeypatch.setattr(allreduce.CupyNccl, "_by_group", {id(group): c})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=1234))
    for dtype, nccl_type in ((torch.bfloat16, 9), (torch.float16, 6), (torch.float32, 7)):
        calls.clear()
        x = torch.ones(5, dtype=dtype)
        assert allreduce.cupy_inplace(x, group) is x
        out = allreduce.cupy_outplace(x, group)
        assert out.shape == x.shape and out.dtype == dtype and out.data_ptr() != x.data_ptr()
        assert calls == [(x.data_ptr(), x.data_ptr(), 5, nccl_type, 0, 1234),
                         (x.data_ptr(), out.data_ptr(), 5, nccl_type, 0, 1234)]
    c.nccl = types.SimpleNamespace(NCCL_BFLOAT16=109, NCCL_SUM=100)  # CuPy's names win where it has them
    allreduce.cupy_inplace(torch.ones(2, dtype=torch.bfloat16), group)
    assert calls[-1][3:5] == (109, 100)


def _host_symm_buffers(monkeypatch) -> list:
    """SymmBuffer over host tensors (NaN-filled, group name "g"), none kept from before;
    the returned list gathers each buffer's (numel, dtype) as it is made."""
    from microbench.kernels import allreduce

    made = []

    def init(self, group, numel, dtype, device):
        made.append((numel, dtype))
        self.buf, self.group_name = torch.full((numel,), float("nan"), dtype=dtype), "g"

    monkeypatch.setattr(allreduce.SymmBuffer, "__init__", init)
    monkeypatch.setattr(allreduce.SymmBuffer, "_by_key", {})
    return made


def test_symmetric_memory_paths_stage_the_input_and_write_in_place_or_a_fresh_output(monkeypatch):
    """Each call copies its input into the group's symmetric buffer and runs the path's
    kernel on that; a stand-in kernel doubles what it reads (two ranks, the same input)."""
    import types

    from microbench.kernels import allreduce

    made, ran = _host_symm_buffers(monkeypatch), []

    def kernel(name):
        def run(staged, op, group_name, out):
            ran.append((name, op, group_name, staged.data_ptr()))
            out.copy_(staged * 2)
        return run

    monkeypatch.setattr(torch.ops, "symm_mem", types.SimpleNamespace(
        one_shot_all_reduce_out=kernel("one"), two_shot_all_reduce_out=kernel("two")))
    group = object()
    for i, (fn, name, in_place) in enumerate([(allreduce.oneshot_inplace, "one", True),
                                              (allreduce.oneshot_outplace, "one", False),
                                              (allreduce.twoshot_inplace, "two", True),
                                              (allreduce.twoshot_outplace, "two", False)]):
        x = torch.arange(1.0, 5.0) + i  # a new input each call: the staged copy is this call's
        before = x.clone()
        out = fn(x, group)
        buf = allreduce.SymmBuffer.get(group, 4, torch.float32, "cpu").buf
        assert ran[-1] == (name, "sum", "g", buf.data_ptr())
        assert torch.equal(out, 2 * before)
        assert (out is x) if in_place else (out.data_ptr() != x.data_ptr() and torch.equal(x, before))
    assert made == [(4, torch.float32)]  # one buffer for the group, kept


def test_a_symmetric_buffer_is_kept_per_group_and_dtype_and_grown_for_a_larger_call(monkeypatch):
    from microbench.kernels import allreduce

    made = _host_symm_buffers(monkeypatch)
    g, other = object(), object()
    first = allreduce.SymmBuffer.get(g, 8, torch.bfloat16, "cuda:0")
    assert allreduce.SymmBuffer.get(g, 8, torch.bfloat16, "cuda:0") is first
    assert allreduce.SymmBuffer.get(g, 4, torch.bfloat16, "cuda:0") is first  # a smaller call fits
    grown = allreduce.SymmBuffer.get(g, 16, torch.bfloat16, "cuda:0")
    assert grown is not first and grown.buf.numel() == 16
    assert allreduce.SymmBuffer.get(g, 4, torch.float32, "cuda:0").buf.dtype == torch.float32
    assert allreduce.SymmBuffer.get(other, 4, torch.bfloat16, "cuda:0") is not grown
    assert made == [(8, torch.bfloat16), (16, torch.bfloat16), (4, torch.float32), (4, torch.bfloat16)]
