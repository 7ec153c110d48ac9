"""``microbench model``: the step-time model on the command line (see microbench.budget)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def cmd_model(a: argparse.Namespace) -> int:
    import json as _json

    from microbench.budget import MODES, Scenario, budget
    from microbench.budget_table import render
    from microbench.measured import Measured
    from microbench.layout import ParallelLayout
    from microbench.models import load_model
    from microbench.cli import UsageError
    from microbench.cli_paths import check_output_file
    from microbench.results import ResultError

    try:
        measured = Measured(a.results or [])
    except ResultError as e:
        raise UsageError(str(e)) from None
    hw, hw_note = _profile(a.hardware, measured)
    s = Scenario(model=load_model(a.model), layout=ParallelLayout(a.tp, a.ep), hw=hw,
                 batch=a.batch, context=a.context, draft_tokens=a.draft_tokens,
                 accept_len=a.accept_len if a.accept_len is not None else float(a.draft_tokens),
                 attention=a.attention, moe=a.moe, draft_s=None if a.draft_ms is None else a.draft_ms * 1e-3)
    b = budget(s, measured)
    if hw_note:
        b.notes.append(hw_note)
    if a.plot:
        from microbench.plots import PlotError, plot_budget

        check_output_file(a.plot, "--plot")
        try:
            print(f"plot: {plot_budget(b, a.plot)}", file=sys.stderr)
        except PlotError as e:
            raise UsageError(str(e)) from None
    if a.json:
        print(_json.dumps(b.to_dict(), indent=1))
        return 0
    modes = ("graph",) if a.graph else ("eager",) if a.eager else MODES
    print(render(b, a.format, modes), end="")
    return 0


#: the profile ``--hardware auto`` falls back to when no result file names a shipped one
DEFAULT_PROFILE = "h200"


def _profile(name: str, measured) -> tuple[Any, str | None]:
    """``--hardware``: a profile by name or path; ``auto``, the shipped profile of the GPU the
    result files ran on (roofline lines on one GPU's ceilings beside another's measured lines
    would mix two machines), else h200. Returns it and, when auto chose, a note saying why."""
    from microbench.hardware import load_profile, profile_for_device_name

    if name != "auto":
        return load_profile(name), None
    gpus = measured.gpus
    prof = profile_for_device_name(gpus[0]) if gpus else None
    if prof is not None:
        why = f"the GPU of the results, {gpus[0]}"
    else:
        prof = load_profile(DEFAULT_PROFILE)
        why = f"no shipped profile matches {gpus[0]}" if gpus else "no GPU result among the --results files"
    more = f"; the result files ran on {len(gpus)} GPUs ({', '.join(gpus)}), the first decides" if len(gpus) > 1 else ""
    return prof, f"hardware profile {prof.name} (--hardware auto: {why}{more})"


def add_parser(sub) -> None:
    from microbench.hardware import shipped_listing

    mo = sub.add_parser("model", help="compose component times into decode and verify step budgets",
                        description="Per-layer and per-step time of one rank for decode and for the verify step "
                        "of speculative decoding, eager and under CUDA-graph replay: each component from a result "
                        "file when it holds that point (--results), else a roofline on the hardware profile; "
                        "every line says which. Then decode and speculative tokens/s and the break-even "
                        "acceptance length.")
    mo.add_argument("--model", default="kimi-k2.5", help="a shipped model or a config.json path (default kimi-k2.5)")
    mo.add_argument("--tp", type=int, default=8, help="tensor-parallel size (default 8)")
    mo.add_argument("--ep", type=int, default=1, help="expert-parallel size: 1 or --tp (default 1)")
    mo.add_argument("--hardware", default="auto", help=f"a shipped profile ({shipped_listing()}; a unique "
                    "prefix is enough), a profile JSON path, or auto (default): the profile of the GPU the --results "
                    f"files ran on, else {DEFAULT_PROFILE}")
    mo.add_argument("--batch", type=int, default=1, help="requests per step (default 1)")
    mo.add_argument("--context", type=int, default=4096, help="tokens of context per request (default 4096)")
    mo.add_argument("--draft-tokens", type=int, default=3,
                    help="tokens drafted per request and step; verify scores these + 1 (default 3)")
    mo.add_argument("--accept-len", type=float, help="mean tokens emitted per request and verify step, "
                    "1 .. draft tokens + 1 (default: draft tokens)")
    mo.add_argument("--draft-ms", type=float, help="time of the whole draft phase per step, ms "
                    "(default: estimated as one dense layer + lm_head per draft token)")
    mo.add_argument("--attention", default="extend", help="verify's attention kernel: extend (servers) or verify")
    mo.add_argument("--moe", default="fused", help="the MoE kernel: fused (servers) or few_token")
    mo.add_argument("--results", action="append", metavar="FILE", help="result file(s) whose GPU records "
                    "replace roofline estimates (repeatable)")
    g = mo.add_mutually_exclusive_group()
    g.add_argument("--graph", action="store_true", help="show graph replay only")
    g.add_argument("--eager", action="store_true", help="show eager launch only")
    mo.add_argument("--format", choices=["text", "markdown"], default="text")
    mo.add_argument("--json", action="store_true", help="print the budget as JSON")
    mo.add_argument("--plot", metavar="PNG", help="also draw the step as stacked per-component bars (matplotlib)")
    mo.set_defaults(func=cmd_model)
