"""A starting point for moe.align: one Triton program per expert, in two launches (count, then place).

Signature (microbench list --case moe.align):
  fn(topk_ids, num_experts, block_size, sorted_ids, expert_of_block, num_padded)
      -> (sorted_ids, expert_of_block, num_padded)
  topk_ids [T, top_k] int32 (pair p = t * top_k + j is topk_ids[t, j]), num_experts E,
  block_size B; written (and returned): sorted_ids [C] int32, expert_of_block [C / B] int32,
  num_padded [] int32, C the worst-case capacity.  The pairs sorted by expert, stably (pair
  order within an expert); each expert's run padded to a multiple of B with the sentinel
  T * top_k; an expert with no pairs takes no blocks; P = the padded total; block i belongs
  to expert expert_of_block[i]; past P, sorted_ids is T * top_k and expert_of_block is -1.

This is the simplest correct scheme: torch fills the outputs with their sentinels, a counting
kernel builds the histogram (each program scans all the pairs for its expert), and a placing
kernel writes each expert's pairs at its start (the sum of the padded counts of the lower
experts) and its blocks.  Make it fast: one launch, one pass over the pairs (a histogram of
the whole chunk at once, a scan, a stable scatter), no separate fills.

Check and time it:   microbench try THIS_FILE::my_align --case moe.align
Iterate on save:     microbench try THIS_FILE::my_align --case moe.align --watch
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _my_count_kernel(ids_ptr, counts_ptr, N, CHUNK: tl.constexpr):
    expert = tl.program_id(0)
    c = tl.arange(0, CHUNK)
    count = 0
    for p0 in range(0, N, CHUNK):
        ids = tl.load(ids_ptr + p0 + c, mask=p0 + c < N, other=-1)
        count += tl.sum((ids == expert).to(tl.int32), axis=0)
    tl.store(counts_ptr + expert, count)


@triton.jit
def _my_place_kernel(ids_ptr, counts_ptr, sorted_ptr, blocks_ptr, npad_ptr, N, E, BS,
                     CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    expert = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    padded = (tl.load(counts_ptr + e, mask=e < E, other=0) + BS - 1) // BS * BS
    if expert == 0:
        tl.store(npad_ptr, tl.sum(padded, axis=0))
    start = tl.sum(tl.where(e < expert, padded, 0), axis=0)  # this expert's run starts here
    # the expert's pairs, in pair order: a running count plus the rank within the chunk
    c = tl.arange(0, CHUNK)
    filled = 0
    for p0 in range(0, N, CHUNK):
        ids = tl.load(ids_ptr + p0 + c, mask=p0 + c < N, other=-1)
        hit = (ids == expert).to(tl.int32)
        tl.store(sorted_ptr + start + filled + tl.cumsum(hit, axis=0) - 1, p0 + c, mask=hit != 0)
        filled += tl.sum(hit, axis=0)
    # the expert's blocks (its padding slots already hold the sentinel)
    n_blocks = tl.sum(tl.where(e == expert, padded, 0), axis=0) // BS
    for b0 in range(0, n_blocks, CHUNK):
        tl.store(blocks_ptr + start // BS + b0 + c, expert, mask=b0 + c < n_blocks)


def my_align(topk_ids, num_experts, block_size, sorted_ids, expert_of_block, num_padded):
    n = topk_ids.numel()
    assert topk_ids.is_contiguous() and 1 <= num_experts
    sorted_ids.fill_(n)  # the sentinel: padding within runs and everything past P
    expert_of_block.fill_(-1)
    if n == 0:
        num_padded.fill_(0)
        return sorted_ids, expert_of_block, num_padded
    counts = torch.empty(num_experts, dtype=torch.int32, device=topk_ids.device)
    _my_count_kernel[(num_experts,)](topk_ids, counts, n, CHUNK=128)
    _my_place_kernel[(num_experts,)](topk_ids, counts, sorted_ids, expert_of_block, num_padded, n, num_experts,
                                     block_size, CHUNK=128, BLOCK_E=triton.next_power_of_2(num_experts))
    return sorted_ids, expert_of_block, num_padded
