"""MoE routing and alignment: references against direct loops, kernels against references.

``router_ref`` is checked against a per-token loop in float64 Python (sort by key, the
tie rule written out), ``route`` against ``router_ref``; ``align_ref`` against the layout
rules it promises, ``align`` against ``align_ref``.  Inputs are seeded random values;
routing shapes are small and odd (T = 7, H = 37, groups of 6 experts), alignment covers
odd T, experts with no pairs, all pairs on one expert, top_k == E and several chunks.
On CPU the kernels run under Triton's interpreter (tests/conftest.py switches it on);
the bf16 tests at Kimi-K2.5 shapes run on a CUDA device only.
"""

from __future__ import annotations

import math

import pytest
import torch

from microbench.kernels import moe_routing
from microbench.kernels.moe_reference import align_capacity, align_cost, align_ref, router_cost, router_ref
from microbench.kernels.moe_routing import align, expert_segments, route, trim_alignment

from .moe_helpers import router_inputs as _router_inputs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# (E, n_group, topk_group, top_k, routed_scaling_factor, renormalize, with_bias)
DEEPSEEK = (32, 8, 4, 4, 2.5, True, True)  # DeepSeek-V3's grouping, scaled down
KIMI = (48, 1, 1, 8, 2.827, True, True)  # Kimi-K2.5: one group, top-8
ODD_GROUPS = (24, 4, 2, 3, 1.0, False, False)  # groups of 6 (padded tile), no bias
SINGLETON_GROUPS = (8, 8, 3, 2, 1.5, True, True)  # one expert per group
# three groups (a padded group row in the kernel's tile): one dropped, and none dropped;
# both scale weights that are not renormalised
THREE_GROUPS_DROP_ONE = (18, 3, 2, 4, 1.7, False, True)
THREE_GROUPS_KEEP_ALL = (18, 3, 3, 5, 0.6, False, True)
CONFIGS = [pytest.param(DEEPSEEK, id="deepseek"), pytest.param(KIMI, id="kimi"),
           pytest.param(ODD_GROUPS, id="odd-groups"), pytest.param(SINGLETON_GROUPS, id="singleton-groups"),
           pytest.param(THREE_GROUPS_DROP_ONE, id="three-groups-drop-one"),
           pytest.param(THREE_GROUPS_KEEP_ALL, id="three-groups-keep-all")]


def _router_loop(hidden, gate, bias, *, top_k, n_group, topk_group, factor, renormalize):
    """The router written out per token with Python floats (float64) and sorted()."""
    T, E = hidden.shape[0], gate.shape[0]
    gs = E // n_group
    w_rows, id_rows = [], []
    for t in range(T):
        logits = (gate.double().cpu() @ hidden[t].double().cpu()).tolist()
        scores = [1.0 / (1.0 + math.exp(-v)) for v in logits]
        biased = [s + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(scores)]
        # with the correction bias a group scores its two best; without, its best (DeepSeek-V3's Gate)
        gscore = [sum(sorted(biased[g * gs:(g + 1) * gs], reverse=True)[:2 if bias is not None else 1])
                  for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
        cand = [e for e in range(E) if e // gs in kept]
        chosen = sorted(cand, key=lambda e: (-biased[e], e))[:top_k]
        w = [scores[e] for e in chosen]
        if renormalize:
            total = sum(w)
            w = [v / total for v in w]
        w_rows.append([v * factor for v in w])
        id_rows.append(chosen)
    return torch.tensor(w_rows, dtype=torch.float64), torch.tensor(id_rows, dtype=torch.int32)


def _kwargs(cfg):
    E, ng, tg, k, factor, renorm, _ = cfg
    return dict(top_k=k, n_group=ng, topk_group=tg, routed_scaling_factor=factor, renormalize=renorm)


# --------------------------------------------------------------------------------------
# router_ref
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", CONFIGS)
def test_router_ref_matches_loop(cfg):
    E, ng, tg, k, factor, renorm, with_bias = cfg
    hidden, gate, bias = _router_inputs(7, 37, E, torch.float32, seed=11, with_bias=with_bias)
    w, ids = router_ref(hidden, gate, bias, **_kwargs(cfg))
    lw, lids = _router_loop(hidden, gate, bias, top_k=k, n_group=ng, topk_group=tg,
                            factor=factor, renormalize=renorm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (7, k)
    assert torch.equal(ids.cpu(), lids)
    torch.testing.assert_close(w.cpu().double(), lw, rtol=1e-5, atol=1e-6)


def test_router_ref_grouping_changes_the_choice():
    """The DeepSeek case must exercise the group mask: some token's grouped choice differs
    from a plain top-k over all experts (otherwise the test above could not see it)."""
    E, ng, tg, k = DEEPSEEK[:4]
    hidden, gate, bias = _router_inputs(7, 37, E, torch.float32, seed=11, with_bias=True)
    _, ids = router_ref(hidden, gate, bias, **_kwargs(DEEPSEEK))
    biased = torch.sigmoid(hidden.float() @ gate.float().T) + bias
    plain = biased.topk(k, dim=-1).indices.to(torch.int32)
    assert not torch.equal(ids.sort(-1).values, plain.sort(-1).values)
    groups_used = (ids.long() // (E // ng)).tolist()
    assert all(len(set(row)) <= tg for row in groups_used)


def test_router_bias_chooses_but_does_not_weigh():
    E, ng, tg, k, factor = KIMI[:5]
    hidden, gate, bias = _router_inputs(5, 37, E, torch.float32, seed=3, with_bias=True)
    bias[17] = 5.0  # larger than any score gap: expert 17 is every token's first choice
    w, ids = router_ref(hidden, gate, bias, **_kwargs(KIMI))
    assert (ids[:, 0] == 17).all()
    scores = torch.sigmoid(hidden.float() @ gate.float().T)
    chosen = scores.gather(1, ids.long())
    torch.testing.assert_close(w, chosen / chosen.sum(-1, keepdim=True) * factor)


# --------------------------------------------------------------------------------------
# route (the kernel) against router_ref
# --------------------------------------------------------------------------------------


def _assert_routing_matches(w, ids, hidden, gate, bias, cfg, *, exact: bool, sel_atol: float, rtol: float):
    """Compare a routing with router_ref's; ``exact=False`` tolerates swaps between experts
    whose biased scores differ by less than ``sel_atol`` (GEMMs that round differently)."""
    E, ng, tg, k, factor, renorm, _ = cfg
    ref_w, ref_ids = router_ref(hidden, gate, bias, **_kwargs(cfg))
    assert w.shape == ids.shape == (hidden.shape[0], k)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert not torch.isnan(w).any()
    if exact:
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w, ref_w, rtol=rtol, atol=rtol)
        return
    assert ((ids >= 0) & (ids < E)).all()
    assert all(len(set(row)) == k for row in ids.tolist())
    scores = torch.sigmoid(hidden.float() @ gate.float().T)
    biased = scores if bias is None else scores + bias
    mine = biased.gather(1, ids.long())
    theirs = biased.gather(1, ref_ids.long())
    torch.testing.assert_close(mine, theirs, rtol=0, atol=sel_atol)  # same choice up to near-ties
    expect = scores.gather(1, ids.long())
    if renorm:
        expect = expect / expect.sum(-1, keepdim=True)
    torch.testing.assert_close(w, expect * factor, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_route_matches_ref(cfg, dtype):
    hidden, gate, bias = _router_inputs(7, 37, cfg[0], dtype, seed=23, with_bias=cfg[6])
    w, ids = route(hidden, gate, bias, **_kwargs(cfg))
    # Same fp32 logits as the reference on CPU (the gate GEMM runs upcast), so the same ids.
    _assert_routing_matches(w, ids, hidden, gate, bias, cfg, exact=not CUDA, sel_atol=1e-5, rtol=1e-5)


def test_route_no_tokens():
    hidden, gate, bias = _router_inputs(0, 37, 48, torch.float32, seed=1, with_bias=True)
    w, ids = route(hidden, gate, bias, **_kwargs(KIMI))
    assert w.shape == ids.shape == (0, 8)


def _logit_inputs(logits: list[list[float]]):
    """hidden rows that are the logits themselves (an identity gate): exact fp32 scores."""
    hidden = torch.tensor(logits, dtype=torch.float32, device=DEVICE)
    return hidden, torch.eye(hidden.shape[1], dtype=torch.float32, device=DEVICE)


@pytest.mark.parametrize(("with_bias", "want_ids"), [
    # with a (zero) correction bias a group scores its two best: group 0 (two tied bests)
    # beats group 1 (a higher best, a lower sum); groups 2 and 3 tie: keep 0 and 2
    pytest.param(True, [[0, 1, 8], [0, 1, 2]], id="bias-top2-sum"),
    # without one a group scores its best (DeepSeek-V3's Gate): groups 1 and 0
    pytest.param(False, [[4, 0, 1], [0, 1, 2]], id="no-bias-max"),
])
def test_route_and_router_ref_break_ties_to_the_lower_index(with_bias, want_ids):
    """Equal scores, equal pairs of top scores inside a group, and equal group scores: the
    lower expert and the lower group win, as the loop writes out."""
    cfg = (16, 4, 2, 3, 2.0, True, with_bias)
    hidden, gate = _logit_inputs([
        [2.0, 2.0, -3, -3, 2.5, 0.5, -3, -3, 1.5, 1.5, -3, -3, 1.5, 1.5, -3, -3],
        [0.0] * 16,  # everything tied: groups 0 and 1, experts 0, 1, 2
    ])
    bias = torch.zeros(16, device=DEVICE) if with_bias else None
    lw, lids = _router_loop(hidden, gate, bias, top_k=3, n_group=4, topk_group=2, factor=2.0, renormalize=True)
    assert lids.tolist() == want_ids
    for w, ids in (router_ref(hidden, gate, bias, **_kwargs(cfg)), route(hidden, gate, bias, **_kwargs(cfg))):
        assert ids.cpu().tolist() == want_ids
        torch.testing.assert_close(w.cpu().double(), lw, rtol=1e-6, atol=1e-6)


# the interpreter's numpy max of a row whose open lanes hold a NaN warns about it
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_fewer_finite_scores_than_top_k_never_choose_an_expert_twice():
    """A -inf bias masking all but two experts, top-4: the two, then the masked ones in id
    order, as the reference's stable sort gives; a NaN score never repeats an id either."""
    cfg = (8, 1, 1, 4, 1.0, True, True)
    hidden, gate = _logit_inputs([[0.5, -0.5, 1.0, 0.0, 0.2, 0.3, -1.0, 0.1]])
    bias = torch.full((8,), float("-inf"), device=DEVICE)
    bias[3], bias[5] = 0.0, 0.0
    ids_ref = router_ref(hidden, gate, bias, **_kwargs(cfg))[1].cpu().tolist()
    assert ids_ref == [[5, 3, 0, 1]]
    assert route(hidden, gate, bias, **_kwargs(cfg))[1].cpu().tolist() == ids_ref
    nan = hidden.clone()
    nan[0, 2] = float("nan")
    ids = route(nan, gate, torch.zeros(8, device=DEVICE), **_kwargs(cfg))[1].cpu().tolist()[0]
    assert len(set(ids)) == 4 and all(0 <= i < 8 for i in ids), ids


# the interpreter's sigmoid overflows exp(200) to inf on the way to its 0
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_renormalised_weights_of_underflowing_scores_are_zero_not_nan():
    """Every sigmoid underflows to 0 (all tied: the lowest ids): the 1e-20 in the
    denominator keeps the weights 0."""
    cfg = (8, 1, 1, 2, 2.5, True, False)
    hidden, gate = _logit_inputs([[-200.0] * 8, [-200.0] * 7 + [-150.0]])
    for w, ids in (router_ref(hidden, gate, None, **_kwargs(cfg)), route(hidden, gate, None, **_kwargs(cfg))):
        assert ids.cpu().tolist() == [[0, 1], [0, 1]]
        assert torch.equal(w.cpu(), torch.zeros(2, 2))


def test_top_k_may_take_every_expert_of_the_kept_groups():
    cfg = (8, 4, 2, 4, 1.5, True, True)  # top_k = topk_group * E / n_group
    hidden, gate, bias = _router_inputs(5, 37, 8, torch.float32, seed=29, with_bias=True)
    w, ids = route(hidden, gate, bias, **_kwargs(cfg))
    _assert_routing_matches(w, ids, hidden, gate, bias, cfg, exact=not CUDA, sel_atol=1e-5, rtol=1e-5)
    for row in ids.tolist():  # two whole groups of two
        assert sorted(e // 2 for e in row) in ([a, a, b, b] for a in range(4) for b in range(a + 1, 4))


# --------------------------------------------------------------------------------------
# align_ref and align
# --------------------------------------------------------------------------------------


def _ids(pattern: str, T: int, seed: int) -> tuple[torch.Tensor, int]:
    """topk_ids [T, k] int32 and E for a named routing pattern."""
    g = torch.Generator().manual_seed(seed)
    if pattern == "sparse":  # only even experts of 16: half the experts get nothing
        E, k = 16, 2
        rows = [2 * torch.randperm(E // 2, generator=g)[:k] for _ in range(T)]
    elif pattern == "one-expert":  # every pair on expert 5, three per token
        E, k = 8, 3
        rows = [torch.full((k,), 5) for _ in range(T)]
    elif pattern == "all-experts":  # top_k == E: each token a permutation of the experts
        E, k = 8, 8
        rows = [torch.randperm(E, generator=g) for _ in range(T)]
    elif pattern == "kimi":  # Kimi-K2.5's 384 experts, top-8: several chunks of pairs
        E, k = 384, 8
        rows = [torch.randperm(E, generator=g)[:k] for _ in range(T)]
    else:
        raise AssertionError(pattern)
    return torch.stack(rows).to(torch.int32), E


def _assert_layout(sorted_ids, blocks, P, topk_ids, E, bs):
    """The layout rules align_ref promises, checked from their definitions."""
    n = topk_ids.numel()
    flat = topk_ids.reshape(-1).tolist()
    s, b = sorted_ids.tolist(), blocks.tolist()
    assert P == len(s) == bs * len(b)
    real = [x for x in s if x != n]
    assert sorted(real) == list(range(n))  # every pair exactly once
    for i, e in enumerate(b):
        assert all(flat[x] == e for x in s[i * bs:(i + 1) * bs] if x != n)
    runs = {}
    for i, e in enumerate(b):
        runs.setdefault(e, []).extend(s[i * bs:(i + 1) * bs])
    assert b == sorted(b)  # experts in order, each a contiguous run
    for e in range(E):
        mine = [p for p in range(n) if flat[p] == e]
        run = runs.get(e, [])
        assert len(run) == -(-len(mine) // bs) * bs  # padded to a block multiple, no more
        assert run[:len(mine)] == mine and all(x == n for x in run[len(mine):])  # stable


PATTERNS = ["sparse", "one-expert", "all-experts"]


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("T", [1, 3, 7])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_align_ref_layout(pattern, T, bs):
    topk_ids, E = _ids(pattern, T, seed=T)
    _assert_layout(*align_ref(topk_ids, E, bs), topk_ids, E, bs)


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("T", [1, 3, 7])
@pytest.mark.parametrize("pattern", PATTERNS + ["kimi"])
def test_align_matches_ref(pattern, T, bs):
    topk_ids, E = _ids(pattern, T, seed=100 + T)
    topk_ids = topk_ids.to(DEVICE)
    sorted_ids, blocks, num_padded = align(topk_ids, E, bs)
    ref_sorted, ref_blocks, ref_p = align_ref(topk_ids, E, bs)
    assert sorted_ids.dtype == blocks.dtype == num_padded.dtype == torch.int32
    assert num_padded.dim() == 0 and num_padded.device == topk_ids.device
    assert sorted_ids.numel() == moe_routing.align_capacity(topk_ids.numel(), E, bs)
    assert sorted_ids.numel() == bs * blocks.numel()
    trimmed, trimmed_blocks, p = trim_alignment(sorted_ids, blocks, num_padded)
    assert p == ref_p
    assert torch.equal(trimmed, ref_sorted) and torch.equal(trimmed_blocks, ref_blocks)
    # Past the padded total: the sentinel and -1, written by the kernel, not left over.
    assert (sorted_ids[p:] == topk_ids.numel()).all() and (blocks[p // bs:] == -1).all()


def test_align_many_chunks():
    """104 pairs over 48 experts: four chunks of the kernel's pair loop, uneven counts."""
    g = torch.Generator().manual_seed(7)
    topk_ids = torch.stack([torch.randperm(48, generator=g)[:8] for _ in range(13)]).to(torch.int32)
    topk_ids[:, 0] = 3  # one hot expert
    out = trim_alignment(*align(topk_ids.to(DEVICE), 48, 16))
    ref = align_ref(topk_ids, 48, 16)
    assert out[2] == ref[2] and torch.equal(out[0].cpu(), ref[0]) and torch.equal(out[1].cpu(), ref[1])


def test_align_out_of_range_ids():
    topk_ids = torch.tensor([[0, 2], [5, 1], [-1, 2]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="topk_ids"):
        align_ref(topk_ids, 4, 16)
    with pytest.raises(ValueError, match="topk_ids"):
        align(topk_ids, 4, 16, check=True)
    # Unchecked, the bad pairs (2: expert 5, 4: expert -1) are dropped, the rest aligned.
    s, b, p = trim_alignment(*align(topk_ids, 4, 16))
    real = sorted(x for x in s.tolist() if x != 6)
    assert real == [0, 1, 3, 5] and b.tolist() == [0, 1, 2] and p == 48


def test_align_no_pairs():
    topk_ids = torch.empty(0, 8, dtype=torch.int32, device=DEVICE)
    s, b, p = trim_alignment(*align(topk_ids, 16, 16))
    assert s.numel() == b.numel() == p == 0
    assert align_ref(topk_ids, 16, 16)[2] == 0


def test_align_runs_that_fill_whole_blocks_take_no_extra_block():
    """Experts with exactly one and two blocks of pairs: P is the pair count, no padding."""
    topk_ids = torch.empty(32, 2, dtype=torch.int32)
    topk_ids[:, 0] = 1  # 32 pairs: two blocks
    topk_ids[:16, 1], topk_ids[16:, 1] = 3, 0  # 16 pairs each: one block
    ref = align_ref(topk_ids, 4, 16)
    _assert_layout(*ref, topk_ids, 4, 16)
    assert ref[2] == 64 and ref[1].tolist() == [0, 1, 1, 3] and (ref[0] != 64).all()
    out = trim_alignment(*align(topk_ids.to(DEVICE), 4, 16))
    assert out[2] == 64 and torch.equal(out[0].cpu(), ref[0]) and torch.equal(out[1].cpu(), ref[1])


def test_align_drops_ids_between_num_experts_and_the_next_power_of_two():
    """E = 6 (a tile of 8 expert lanes): ids 6 and 7, like -1, are dropped unchecked."""
    topk_ids = torch.tensor([[0, 6], [7, 2], [5, 2], [-1, 0]], dtype=torch.int32, device=DEVICE)
    s, b, p = trim_alignment(*align(topk_ids, 6, 4))
    assert p == 12 and b.tolist() == [0, 2, 5]
    assert s.tolist() == [0, 7, 8, 8, 3, 5, 8, 8, 4, 8, 8, 8]
    sorted_ids, seg_e, seg_start, seg_cnt, nseg = expert_segments(topk_ids, 6)
    n = int(nseg)
    assert (seg_e[:n].tolist(), seg_start[:n].tolist(), seg_cnt[:n].tolist()) == ([0, 2, 5], [0, 2, 4], [2, 2, 1])
    assert sorted_ids[:5].tolist() == [0, 7, 3, 5, 4]


def test_align_capacity_and_costs_by_hand():
    # each touched expert pads by at most block - 1, and at most min(E, pairs) are touched:
    # 3 pairs over 384 experts at block 16: 3 + 3 * 15 = 48 (three blocks, all reached
    # when the three pairs go to three experts)
    assert align_capacity(3, 384, 16) == 48
    assert align_ref(torch.tensor([[5, 9, 300]], dtype=torch.int32), 384, 16)[2] == 48
    # 10 pairs over 4 experts: 10 + 4 * 15 = 70, rounded up to whole blocks: 80
    assert align_capacity(10, 4, 16) == 80
    assert align_capacity(5, 8, 1) == 5 and align_capacity(0, 8, 16) == 0
    # read 10 ids, write 80 sorted ids, 5 block experts and the padded total: 4 bytes each
    assert align_cost(10, 4, 16) == (4 * (10 + 80 + 5 + 1), 0)
    # T = 4, H = 64, E = 16, top-2, bf16: (T*H + E*H) * 2 + 4*E (fp32 bias) + 8*T*top_k
    # (fp32 weights and int32 ids out); FLOPs 2*T*H*E (gate GEMM) + T*E (bias add)
    assert router_cost(4, 64, 16, 2, 2) == ((4 * 64 + 16 * 64) * 2 + 64 + 64, 2 * 4 * 64 * 16 + 64)


class _GuardedTorch:
    """``torch`` whose ``empty`` returns the head of a longer buffer: the tail, filled with
    a marker, shows whether a kernel wrote past the tensor it was given."""

    MARK, TAIL = 77, 64

    def __init__(self):
        self.made: list[tuple[torch.Tensor, int]] = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *size, dtype=None, device=None):
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        n = math.prod(shape)
        buf = torch.full((n + self.TAIL,), self.MARK, dtype=dtype, device=device)
        self.made.append((buf, n))
        return buf[:n].view(shape)

    def untouched(self) -> bool:
        return all(bool((buf[n:] == self.MARK).all()) for buf, n in self.made)


def test_route_and_align_write_nothing_past_their_outputs(monkeypatch):
    """top_k = 3 and block size 3 are not powers of two: the kernels' tiles are wider than
    what they store, and the masks must stop at the outputs' ends."""
    guarded = _GuardedTorch()
    monkeypatch.setattr(moe_routing, "torch", guarded)
    hidden, gate, bias = _router_inputs(5, 37, 24, torch.float32, seed=41, with_bias=True)
    w, ids = route(hidden, gate, bias, **_kwargs(ODD_GROUPS))
    _assert_routing_matches(w, ids, hidden, gate, bias, ODD_GROUPS, exact=not CUDA, sel_atol=1e-5, rtol=1e-5)
    for bs in (3, 16):
        out = trim_alignment(*align(ids, 24, bs))
        ref = align_ref(ids, 24, bs)
        assert out[2] == ref[2] and torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert len(guarded.made) == 8 and guarded.untouched()


# --------------------------------------------------------------------------------------
# GPU: bf16 at Kimi-K2.5 shapes (T 4 draft tokens, H 7168, E 384)
# --------------------------------------------------------------------------------------

KIMI_FULL = (384, 1, 1, 8, 2.827, True, True)
DEEPSEEK_FULL = (256, 8, 4, 8, 2.5, True, True)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [pytest.param(KIMI_FULL, id="kimi"), pytest.param(DEEPSEEK_FULL, id="deepseek")])
def test_route_bf16_gpu(cfg):
    hidden, gate, bias = _router_inputs(4, 7168, cfg[0], torch.bfloat16, seed=31, with_bias=True)
    w, ids = route(hidden, gate, bias, **_kwargs(cfg))
    torch.cuda.synchronize()
    # bf16 products are exact in fp32, so only the GEMM's summation order differs (~1e-6).
    _assert_routing_matches(w, ids, hidden, gate, bias, cfg, exact=False, sel_atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 64])
def test_align_gpu_kimi(bs):
    hidden, gate, bias = _router_inputs(4, 7168, 384, torch.bfloat16, seed=37, with_bias=True)
    _, ids = route(hidden, gate, bias, **_kwargs(KIMI_FULL))
    out = trim_alignment(*align(ids, 384, bs))
    ref = align_ref(ids, 384, bs)
    assert out[2] == ref[2] and torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
