"""``microbench list``, ``shapes`` and ``env``: the suites, cases, variants and axes there are,
what a model config gives each rank, and what this host is (the fingerprint every result
file stores)."""

from __future__ import annotations

import argparse
import json

from microbench.cli import UsageError, _select_cases, _split, resolve_device


def cmd_shapes(a: argparse.Namespace) -> int:
    """A model config and a parallel layout -> the per-rank shapes every case uses."""
    from tabulate import tabulate

    from microbench.layout import ParallelLayout, rank_shapes
    from microbench.models import ConfigError, load_model

    try:
        model = load_model(a.model)
        shapes = rank_shapes(model, ParallelLayout(tp=a.tp, ep=a.ep))
    except (ConfigError, ValueError) as e:
        raise UsageError(str(e)) from None
    q = model.quant
    rows = list(shapes.as_dict().items())
    rows += [("layers (dense + MoE)", f"{model.n_dense_layers} + {model.n_moe_layers}"),
             ("routed experts", f"{q.routed_experts}" + (f", group {q.group_size}" if q.group_size else "")),
             ("other weights", q.other)]
    print(tabulate(rows, headers=["per-rank shape", "value"], tablefmt="simple", disable_numparse=True))
    return 0


def cmd_env(a: argparse.Namespace) -> int:
    from microbench import env

    device = None if a.device == "auto" else resolve_device(a.device)  # a GPU named must be there
    fp = env.fingerprint(device)
    print(json.dumps(fp, indent=1) if a.json else env.format_fingerprint(fp))
    return 0


def cmd_list(a: argparse.Namespace) -> int:
    from microbench.cases import SUITES

    device = "cuda" if a.device == "auto" else resolve_device(a.device, present=False)
    cases = _select_cases(_split(a.case), a.suite, device)
    if not a.case and not a.suite:
        print("suites:")
        for name, doc in SUITES.items():
            print(f"  {name:<9} {doc}")
        print()
    for c in cases:
        print(f"{c.id}  ({c.title})")
        print("  variants: " + ", ".join(v.name + (" [baseline]" if v.name == c.baseline else "")
                                          for v in c.variants()))
        for s in (SUITES if a.suite is None else [a.suite]):
            axes = c.axes(s, device)
            if axes:
                print(f"  {s} axes ({device}): " + "; ".join(f"{k}={','.join(map(str, v))}" for k, v in axes.items()))
        if a.case:
            for v in c.variants():
                print(f"    {v.name}: {v.doc} (devices: {', '.join(v.devices)})")
            print("  signature: " + "\n  ".join(c.signature().splitlines()))
    return 0


def add_parsers(sub) -> None:
    sh = sub.add_parser("shapes", help="per-rank shapes of a model config at a parallel layout")
    sh.add_argument("--model", default="kimi-k2.5", help="a shipped model name or a path to a config.json")
    sh.add_argument("--tp", type=int, default=8, help="tensor-parallel size (default 8)")
    sh.add_argument("--ep", type=int, default=1, help="expert-parallel size: 1 or equal to --tp (default 1)")
    sh.set_defaults(func=cmd_shapes)

    e = sub.add_parser("env", help="the environment fingerprint stored in every result file")
    e.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    e.add_argument("--json", action="store_true", help="print JSON")
    e.set_defaults(func=cmd_env)
