"""The step-time model: the components put back together into decode and verify budgets.

One rank of a DeepSeek-V3-family model under a TP/EP layout runs, per MoE layer:

    norms, rope, KV write, adds  7 small kernels (input / q_a / kv_a / post norms, rope,
                                 the latent-cache write, routed + shared add)
    attention projections        5 GEMMs: fused q_a/kv_a, q_b, q_nope x w_kc, x w_vc, o_proj
    attention core               decode: the split-KV decode kernel (2 launches); verify:
                                 the extend kernel (1, servers) or the verify kernel (2)
    allreduce x 2                after attention and after the MoE, [T, hidden] bf16
    router                       gate GEMM + grouped top-k (2 launches)
    routed experts               fused (5 launches) or few_token (4)
    shared expert                gate/up GEMM, SiLU-and-mul, down GEMM (3)

a dense layer (``first_k_dense_replace`` of them) has a dense MLP (3 launches) instead of
router + routed + shared, and a step adds the final norm and lm_head. Decode runs
T = batch tokens (q_len 1); verify scores ``draft_tokens + 1`` tokens per request (the
last accepted token and the drafts), T = batch x (draft_tokens + 1).

Each component's GPU time comes from a result file when it holds that component at that
point (``measured``: exact token count / batch / context; the allreduce interpolated in
bytes between measured sizes at the same world size), else from a roofline on the
hardware profile: ``max(bytes / memory_bandwidth, FLOPs / bf16 peak, kernels x
kernel_floor)``; the allreduce from an alpha-beta model of the profile's interconnect,
``alpha + 2(n-1)/n x bytes / beta`` (alpha: the latency of a tiny allreduce; the second
term: the bytes each rank's link carries in a ring). Every line says which.

Launches: in **graph** mode the layer is the sum of its kernels (launch gaps not
modelled); in **eager** mode the host launches each kernel, so the layer takes
``max(GPU sum, launches x launch cost)`` and the difference is the exposed launch line.
The launch cost is the measured eager launch floor (``calibration.launch``, eager) when a
result has it, else the profile's ``launch_overhead``; the kernel floor likewise comes from
the same op replayed from a graph, else the profile's ``kernel_floor``.

Weights are read in the storage the config gives them, scales included
(:meth:`Quantization.matrix_bytes`): the routed experts in theirs, the other projections
(attention's q_a / kv_a, q_b, o_proj; the shared expert; the dense MLP) in the config's
``other`` storage; lm_head, the router gate and the per-head w_kc / w_vc stay bf16.

Speculative decoding: a step drafts ``draft_tokens`` tokens (``draft_s``, or an estimate:
one bf16 dense decoder layer + lm_head per draft step, the shape of an EAGLE-3 head), verifies
them, and emits ``accept_len`` tokens per request on average: tokens/s = batch x
accept_len / (draft + verify); break-even acceptance length = (draft + verify) / decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from microbench.hardware import HardwareProfile
from microbench.layout import ParallelLayout, RankShapes, rank_shapes
from microbench.measured import Measured
from microbench.models import ACTIVATION_BYTES, ConfigError, ModelConfig

PHASES = ("decode", "verify")
MODES = ("eager", "graph")
ATTENTION_KERNELS = {"extend": 1, "verify": 2}  # verify-step attention kernel -> its launches
DECODE_ATTENTION_LAUNCHES = 2  # split-KV stage 1 + merge
MOE_KERNELS = {"fused": 5, "few_token": 4}
#: the figures the budget needs from a profile (beyond the required ones every profile has)
NEEDED = ("launch_overhead", "kernel_floor")


@dataclass(frozen=True)
class Scenario:
    """What to budget: a model on a layout and a GPU, at a batch, context and draft length."""

    model: ModelConfig
    layout: ParallelLayout
    hw: HardwareProfile
    batch: int = 1
    context: int = 4096
    draft_tokens: int = 3
    accept_len: float = 3.0
    attention: str = "extend"  # the verify step's attention kernel
    moe: str = "fused"
    draft_s: float | None = None  # the whole draft phase of one step, seconds

    def check(self) -> None:
        """ConfigError (one line) for a scenario the budget cannot price."""
        for key in ("batch", "context", "draft_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"--{key.replace('_', '-')} must be at least 1, got {getattr(self, key)}")
        if not 1 <= self.accept_len <= self.draft_tokens + 1:
            raise ConfigError(f"--accept-len {self.accept_len:g}: must lie in [1, draft tokens + 1] = "
                              f"[1, {self.draft_tokens + 1}]")
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError(f"--attention {self.attention!r}: use {' or '.join(ATTENTION_KERNELS)}")
        if self.moe not in MOE_KERNELS:
            raise ConfigError(f"--moe {self.moe!r}: use {' or '.join(MOE_KERNELS)}")
        if self.draft_s is not None and not 0 <= self.draft_s < float("inf"):
            raise ConfigError(f"--draft-ms must be a finite time of at least 0, got {self.draft_s * 1e3:g}")
        missing = [k for k in NEEDED if getattr(self.hw, k) is None]
        if missing:
            raise ConfigError(f"hardware profile {self.hw.name}: missing figure {missing[0]!r}, which the budget needs")

    def tokens(self, phase: str) -> int:
        return self.batch * self.q_len(phase)

    def q_len(self, phase: str) -> int:
        return 1 if phase == "decode" else self.draft_tokens + 1


@dataclass
class Cell:
    seconds: float
    source: str


@dataclass
class Line:
    """One component: its time per (phase, mode) and where each came from."""

    name: str
    scope: str  # "MoE layer" | "dense layer" | "step"
    launches: dict[str, int]  # per phase
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)

    def seconds(self, phase: str, mode: str) -> float:
        return self.cells[(phase, mode)].seconds

    def sources(self) -> str:
        seen: list[str] = []
        for c in self.cells.values():
            if c.source not in seen:
                seen.append(c.source)
        return " | ".join(seen)


@dataclass
class Budget:
    scenario: Scenario
    moe_layer: list[Line]
    dense_layer: list[Line]
    step: list[Line]  # lm_head etc., once per step
    totals: dict[str, dict[tuple[str, str], float]]  # "moe layer" / "dense layer" / "step" / "draft"
    launch_cost: Cell
    notes: list[str]
    #: the composed layer as layer.decoder measured it, per (phase, mode), when a result has it
    measured_layer: dict[tuple[str, str], Cell] = field(default_factory=dict)
    #: the model's MoE layer as layer.decoder runs it: one rank, each allreduce a stand-in
    #: kernel (read + write [T, hidden]) instead of a collective, per (phase, mode)
    model_as_measured: dict[tuple[str, str], float] = field(default_factory=dict)

    def model_error(self, phase: str, mode: str) -> float | None:
        """The model of the layer as measured (its allreduces priced as the one-rank stand-ins
        layer.decoder runs) over the measured layer, minus 1; None without a measurement."""
        got = self.measured_layer.get((phase, mode))
        if got is None:
            return None
        return self.model_as_measured[(phase, mode)] / got.seconds - 1.0

    def summary(self, mode: str) -> dict[str, float]:
        """Decode and speculative throughput in ``mode`` (tokens/s over the batch)."""
        s = self.scenario
        dec, ver, dr = (self.totals["step"][("decode", mode)], self.totals["step"][("verify", mode)],
                        self.totals["draft"][("decode", mode)])
        spec = dr + ver
        return {"decode_step_s": dec, "verify_step_s": ver, "draft_s": dr, "spec_step_s": spec,
                "decode_tok_s": s.batch / dec, "spec_tok_s": s.batch * s.accept_len / spec,
                "break_even_accept_len": spec / dec, "speedup": (s.batch * s.accept_len / spec) / (s.batch / dec)}

    def to_dict(self) -> dict[str, Any]:
        def lines(ls):
            return [{"name": x.name, "scope": x.scope, "launches": x.launches,
                     "cells": {f"{p}/{m}": {"seconds": c.seconds, "source": c.source} for (p, m), c in x.cells.items()}}
                    for x in ls]

        s = self.scenario
        return {"scenario": {"model": s.model.name, "tp": s.layout.tp, "ep": s.layout.ep, "hardware": s.hw.name,
                             "batch": s.batch, "context": s.context, "draft_tokens": s.draft_tokens,
                             "accept_len": s.accept_len, "attention": s.attention, "moe": s.moe},
                "moe_layer": lines(self.moe_layer), "dense_layer": lines(self.dense_layer), "step": lines(self.step),
                "totals": {k: {f"{p}/{m}": v for (p, m), v in t.items()} for k, t in self.totals.items()},
                "launch_cost": {"seconds": self.launch_cost.seconds, "source": self.launch_cost.source},
                "summary": {m: self.summary(m) for m in MODES}, "notes": self.notes,
                "measured_layer": {f"{p}/{m}": {"seconds": c.seconds, "source": c.source,
                                                "model_as_measured": self.model_as_measured[(p, m)],
                                                "model_error": self.model_error(p, m)}
                                   for (p, m), c in self.measured_layer.items()}}


# --------------------------------------------------------------------------- estimates


class _Estimator:
    """Per-component GPU time at one phase: measured when a result has it, else roofline."""

    def __init__(self, s: Scenario, measured: Measured):
        self.s, self.m = s, measured
        self.r: RankShapes = rank_shapes(s.model, s.layout)
        hw = s.hw
        self.bw, self.peak = hw.memory_bandwidth.value, hw.bf16_dense_flops.value
        floor = measured.kernel_floor()
        self.floor_cell = floor or Cell(hw.kernel_floor.value, f"profile {hw.name}: {hw.kernel_floor.source}")
        self.floor = self.floor_cell.seconds

    def roof(self, nbytes: float, flops: float, kernels: int, what: str) -> Cell:
        t = max(nbytes / self.bw, flops / self.peak, kernels * self.floor)
        bound = ("floor" if t == kernels * self.floor else "memory" if t == nbytes / self.bw else "compute")
        return Cell(t, f"roofline on {self.s.hw.name} ({what}: {nbytes / 1e6:.2f} MB, "
                       f"{flops / 1e9:.2f} GFLOP, {bound}-bound)")

    def gemm(self, t: int, k: int, n: int, weights: str | None = None) -> tuple[float, float]:
        """Bytes and FLOPs of a [t, k] x [k, n] GEMM with bf16 activations; its weights read
        once, held as ``weights`` (a storage name, scales counted; None: bf16)."""
        w = self.s.model.quant.matrix_bytes(n, k, weights) if weights else k * n * ACTIVATION_BYTES
        return w + (t * k + t * n) * ACTIVATION_BYTES, 2.0 * t * k * n

    # -- attention
    def projections(self, t: int, weights: str | None) -> Cell:
        """The 5 projection GEMMs; q_a/kv_a, q_b and o_proj held as ``weights``, the
        per-head w_kc / w_vc in bf16 (servers dequantise kv_b_proj into them at load)."""
        r = self.r
        h, nope = r.hidden, r.q_head_dim - r.qk_rope_head_dim
        q_in = r.q_lora_rank or h
        shapes = [(h, (r.q_lora_rank or 0) + r.kv_lora_rank + r.qk_rope_head_dim, weights),  # fused q_a / kv_a
                  (q_in, r.heads_per_rank * r.q_head_dim, weights),  # q_b (or the direct q projection)
                  (nope, r.kv_lora_rank * r.heads_per_rank, None),  # q_nope x w_kc, per head
                  (r.kv_lora_rank, r.v_head_dim * r.heads_per_rank, None),  # x w_vc, per head
                  (r.heads_per_rank * r.v_head_dim, h, weights)]  # o_proj
        nb = fl = 0.0
        for k, n, w in shapes:
            b, f = self.gemm(t, k, n, w)
            nb, fl = nb + b, fl + f
        return self.roof(nb, fl, len(shapes), "5 GEMMs")

    def attention(self, phase: str) -> Cell:
        s, r = self.s, self.r
        q_len, kernel = s.q_len(phase), ("decode" if phase == "decode" else s.attention)
        hit = self.m.attention(s.batch, q_len, s.context, kernel, r.heads_per_rank)
        if hit:
            return hit
        t, heads = s.tokens(phase), r.heads_per_rank
        reads = heads if kernel == "extend" else 1  # extend streams the shared latent once per head
        nb = (s.batch * s.context * r.kv_cache_dim * reads + t * heads * (r.kv_cache_dim + r.kv_lora_rank)
              ) * ACTIVATION_BYTES
        fl = 2.0 * t * heads * (s.context + q_len) * (r.kv_cache_dim + r.kv_lora_rank)
        launches = DECODE_ATTENTION_LAUNCHES if phase == "decode" else ATTENTION_KERNELS[kernel]
        return self.roof(nb, fl, launches, f"{kernel} kernel")

    def small_ops(self, t: int) -> Cell:
        r = self.r
        h = r.hidden
        norms = self.m.norms(t, {"input": h, "q_a": r.q_lora_rank, "kv_a": r.kv_lora_rank})
        rest_bytes = (t * (r.heads_per_rank + 1) * r.qk_rope_head_dim * 2  # rope on q and k
                      + t * r.kv_cache_dim * 2 + 3 * t * h) * ACTIVATION_BYTES  # cache write, routed+shared add
        rest = self.roof(rest_bytes, 0.0, 3, "rope, cache write, add")
        if norms:
            return Cell(norms.seconds + rest.seconds, f"{norms.source} + {rest.source}")
        q = r.q_lora_rank or 0
        norm_bytes = (2 * 4 * t * h + 2 * t * (q + r.kv_lora_rank) + 2 * h + q + r.kv_lora_rank) * ACTIVATION_BYTES
        return self.roof(norm_bytes + rest_bytes, 0.0, 7, "4 norms, rope, cache write, add")

    # -- communication
    def allreduce(self, t: int, mode: str) -> Cell:
        n = self.s.layout.tp
        nbytes = t * self.r.allreduce_bytes_per_token
        if n == 1:
            return Cell(0.0, "no allreduce at tp 1")
        hit = self.m.allreduce(nbytes, "graph" if mode == "graph" else "eager", n)
        if hit:
            return Cell(2 * hit.seconds, f"2 x {hit.source}")
        ic = self.s.hw.interconnect
        alpha, beta = ic["latency"].value, ic["bandwidth_per_direction"].value
        one = alpha + 2 * (n - 1) / n * nbytes / beta
        return Cell(2 * one, f"2 x alpha-beta on {self.s.hw.name} {ic['kind']} "
                             f"({nbytes / 1e3:.1f} KB, alpha {alpha * 1e6:g} us, beta {beta / 1e9:g} GB/s)")

    def stand_in(self, t: int) -> Cell:
        """The two kernels layer.decoder runs where a one-rank layer's allreduces would be
        (``x.mul_(1)``: read + write [T, hidden] each)."""
        nbytes = 2 * 2 * t * self.r.hidden * ACTIVATION_BYTES
        return self.roof(nbytes, 0.0, 2, "2 one-rank allreduce stand-ins")

    # -- MLP
    def router(self, t: int) -> Cell:
        hit = self.m.router(self._layout_key(), t)
        if hit:
            return hit
        e = self.s.model.n_routed_experts
        nb, fl = self.gemm(t, self.r.hidden, e)
        return self.roof(nb, fl, 2, "gate GEMM + top-k")

    def touched_experts(self, t: int) -> float:
        """Expected distinct experts a rank serves when T tokens each pick top_k of E
        uniformly (a real router concentrates more: measure it with moe.experts)."""
        m, r = self.s.model, self.r
        e, k = m.n_routed_experts, r.top_k
        distinct = e * (1.0 - (1.0 - k / e) ** t)
        return distinct * r.experts_per_rank / e

    def experts(self, t: int) -> Cell:
        s, r = self.s, self.r
        weights = s.model.quant.routed_experts
        hit = self.m.experts(self._layout_key(), t, weights, s.moe)
        if hit:
            return hit
        h, i, q = r.hidden, r.moe_intermediate_per_rank, s.model.quant
        wbytes = q.matrix_bytes(2 * i, h) + q.matrix_bytes(h, i)  # w13 [2i, h] + w2 [h, i], with scales
        touched = self.touched_experts(t)
        nb = touched * wbytes + 2 * t * h * ACTIVATION_BYTES
        # T x top_k (token, expert) pairs of 3 h i multiply-adds, of which this rank holds its
        # experts' share (all of them, TP-sharded, at ep 1)
        fl = 2.0 * t * r.top_k * 3 * h * i * r.experts_per_rank / s.model.n_routed_experts
        return self.roof(nb, fl, MOE_KERNELS[s.moe], f"{s.moe}, {touched:.1f} experts touched, {weights}")

    def mlp(self, t: int, inter: int, what: str, weights: str | None) -> Cell:
        h = self.r.hidden
        b1, f1 = self.gemm(t, h, 2 * inter, weights)
        b2, f2 = self.gemm(t, inter, h, weights)
        act = 3 * t * inter * ACTIVATION_BYTES
        return self.roof(b1 + b2 + act, f1 + f2, 3, what)

    def lm_head(self, t: int) -> Cell:
        nb, fl = self.gemm(t, self.r.hidden, self.r.vocab_per_rank)
        nb += 2 * t * self.r.hidden * ACTIVATION_BYTES  # final norm
        return self.roof(nb, fl, 2, "final norm + lm_head GEMM")

    def _layout_key(self) -> str:
        name = self.s.model.name.split("-")[0].replace("deepseek", "dsv3")
        kind = "tp" if self.s.layout.ep == 1 else "ep"
        return f"{name}-{kind}{self.s.layout.tp}"


# --------------------------------------------------------------------------- composition


def _attention_lines(est: _Estimator, s: Scenario, scope: str, weights: str | None) -> list[Line]:
    att = {p: DECODE_ATTENTION_LAUNCHES if p == "decode" else ATTENTION_KERNELS[s.attention] for p in PHASES}
    lines = [Line("norms, rope, cache write, adds", scope, {p: 7 for p in PHASES}),
             Line("attention projections (5 GEMMs)", scope, {p: 5 for p in PHASES}),
             Line(f"attention core (decode; verify: {s.attention})", scope, att),
             Line("allreduce x 2", scope, {p: 2 for p in PHASES})]
    for p in PHASES:
        t = s.tokens(p)
        for m in MODES:
            lines[0].cells[(p, m)] = est.small_ops(t)
            lines[1].cells[(p, m)] = est.projections(t, weights)
            lines[2].cells[(p, m)] = est.attention(p)
            lines[3].cells[(p, m)] = est.allreduce(t, m)
    return lines


def _dense_layer(est: _Estimator, s: Scenario, scope: str, inter: int, weights: str | None,
                 cost: Cell) -> tuple[list[Line], dict[tuple[str, str], float]]:
    """A decoder layer with a dense MLP of ``inter`` columns a rank, its projections held as
    ``weights``: its lines, the exposed launches last, and its totals per (phase, mode)."""
    lines = _attention_lines(est, s, scope, weights) + [
        _fill(Line("dense MLP", scope, {p: 3 for p in PHASES}),
              lambda p, m: est.mlp(s.tokens(p), inter, "dense MLP", weights))]
    exposed, totals = _launch_line(lines, scope, cost)
    return lines + [exposed], totals


def _fill(line: Line, fn) -> Line:
    for p in PHASES:
        for m in MODES:
            line.cells[(p, m)] = fn(p, m)
    return line


def _launch_line(lines: list[Line], scope: str, cost: Cell) -> tuple[Line, dict[tuple[str, str], float]]:
    """The exposed launch time per mode and each layer total (see the module docstring)."""
    exposed = Line("launches exposed (eager)", scope, {p: sum(x.launches[p] for x in lines) for p in PHASES})
    totals = {}
    for p in PHASES:
        for m in MODES:
            gpu = sum(x.seconds(p, m) for x in lines)
            host = exposed.launches[p] * cost.seconds
            extra = max(0.0, host - gpu) if m == "eager" else 0.0
            src = (f"max(0, {exposed.launches[p]} launches x {cost.seconds * 1e6:.2f} us - GPU sum)" if m == "eager"
                   else "graph replay: no host launches")
            exposed.cells[(p, m)] = Cell(extra, src)
            totals[(p, m)] = gpu + extra
    return exposed, totals


def budget(s: Scenario, measured: Measured | None = None) -> Budget:
    """The per-layer and per-step budget of scenario ``s`` (ConfigError on bad input)."""
    s.check()
    measured = measured or Measured([])
    est = _Estimator(s, measured)
    r, model = est.r, s.model
    launch = measured.launch_cost() or Cell(s.hw.launch_overhead.value,
                                            f"profile {s.hw.name}: {s.hw.launch_overhead.source}")
    other = s.model.quant.other  # the storage of every weight but the routed experts'
    moe = _attention_lines(est, s, "MoE layer", other) + [
        _fill(Line("router (gate GEMM + top-k)", "MoE layer", {p: 2 for p in PHASES}),
              lambda p, m: est.router(s.tokens(p))),
        _fill(Line(f"routed experts ({s.moe}, {s.model.quant.routed_experts})", "MoE layer",
                   {p: MOE_KERNELS[s.moe] for p in PHASES}), lambda p, m: est.experts(s.tokens(p))),
        _fill(Line("shared expert", "MoE layer", {p: 3 for p in PHASES}),
              lambda p, m: est.mlp(s.tokens(p), r.shared_intermediate_per_rank, "shared expert", other))]
    if not r.shared_intermediate_per_rank:
        moe.pop()
    # the layer as layer.decoder measures it (one rank): stand-ins where the allreduces are
    stand_in = _fill(Line("allreduce stand-ins x 2", "MoE layer", {p: 2 for p in PHASES}),
                     lambda p, m: est.stand_in(s.tokens(p)))
    _, as_measured = _launch_line([stand_in if x.name.startswith("allreduce") else x for x in moe], "MoE layer",
                                  launch)
    moe_exposed, moe_tot = _launch_line(moe, "MoE layer", launch)
    moe.append(moe_exposed)
    if model.n_dense_layers:
        dense, dense_tot = _dense_layer(est, s, "dense layer", r.dense_intermediate_per_rank, other, launch)
    else:  # nothing to show: no layer of the model is dense
        dense, dense_tot = [], {k: 0.0 for k in moe_tot}
    head = [_fill(Line("final norm + lm_head", "step", {p: 2 for p in PHASES}), lambda p, m: est.lm_head(s.tokens(p)))]
    head_exposed, head_tot = _launch_line(head, "step", launch)
    step = {k: model.n_moe_layers * moe_tot[k] + model.n_dense_layers * dense_tot[k] + head_tot[k] for k in moe_tot}
    # the draft phase: given, or D x (one dense layer at the decode batch + lm_head)
    if s.draft_s is not None:
        draft = {k: s.draft_s for k in step}
        draft_src = "given (--draft-ms)"
    else:
        # an EAGLE-3 head: one decoder layer with the model's attention and a dense MLP of
        # intermediate_size, in bf16 whatever the target's weights
        _, draft_layer = _dense_layer(est, s, "draft", -(-model.intermediate_size // s.layout.tp), None, launch)
        draft = {(p, m): s.draft_tokens * (draft_layer[("decode", m)] + head_tot[("decode", m)])
                 for p, m in step}
        draft_src = (f"estimate: {s.draft_tokens} draft steps x (one bf16 dense decoder layer of intermediate "
                     f"{model.intermediate_size} + lm_head at the decode batch), the shape of an EAGLE-3 head; "
                     "pass --draft-ms for a measured one")
    notes = [f"draft phase: {draft_src}",
             f"launch cost per kernel (eager): {launch.seconds * 1e6:.2f} us from {launch.source}",
             f"kernel floor (floor-bound lines): {est.floor * 1e6:.2f} us per kernel from {est.floor_cell.source}",
             "not modelled: embedding, sampling, the logits all-gather, gaps between graph nodes"]
    notes += measured.notes
    variant = {("extend", "fused"): "server", ("verify", "few_token"): "microbench"}.get((s.attention, s.moe))
    layer = {}
    if variant:
        for p in PHASES:
            for m in MODES:
                hit = measured.layer(est._layout_key(), p, s.batch, s.draft_tokens, s.context, m, variant,
                                     s.model.quant.routed_experts)
                if hit:
                    layer[(p, m)] = Cell(hit.seconds, hit.source)
    return Budget(s, moe, dense, head + [head_exposed],
                  {"moe layer": moe_tot, "dense layer": dense_tot, "step": step, "draft": draft}, launch, notes,
                  layer, as_measured)
