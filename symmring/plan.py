"""``python -m symmring plan``: the bytes per PE a workspace takes, by region, and the window it implies.

Prints one line per region (`symmring.moe.workspace_plan.REGIONS`), the window (tokens per rank, chunks, pool
rows, passes of uniform and worst routing), and last ``total per PE: N bytes (X MiB)``. The total does not
depend on ``--layers`` (every layer borrows the one workspace); the line before the total says what one
workspace per layer would have taken. `symmring.Workspace.memory` returns the same regions for a live
workspace.

Example:
    >>> main(["--preset", "mixtral", "--ranks", "8", "--max-tokens", "256"])  # doctest: +ELLIPSIS
    ring ...
    total per PE: ... bytes (... MiB)
    0
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .errors import ConfigError
from .moe.workspace_plan import PRESET_ALIASES, PRESETS, LayerShape, parse_bytes, plan


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m symmring plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS) + sorted(PRESET_ALIASES),
                   help="a model's sizes (the flags below override them; the names of demo --model)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--inter", type=int, help="expert intermediate size")
    p.add_argument("--experts", type=int, help="routed experts over all ranks")
    p.add_argument("--topk", type=int)
    p.add_argument("--ranks", type=int, default=1, help="expert-parallel ranks (PEs)")
    p.add_argument("--max-tokens", type=int, required=True, help="most tokens per rank per call")
    p.add_argument("--layers", type=int, help="MoE layers of the model (default: the preset's, else 1)")
    p.add_argument("--budget", help="bytes per PE (1073741824, 1GiB, 512MiB); default: a window of the whole call")
    p.add_argument("--tokens-per-slot", type=int, help="the ring's chunk (default: the plan's)")
    p.add_argument("--x-format", choices=("fp8_e4m3", "bf16"), default="fp8_e4m3", help="dispatch format")
    p.add_argument("--experts-format", choices=("fp8", "bf16"), default="fp8", help="the pool's rows")
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--rdma", action="store_true", help="count the staging ring of rdma peers")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    sizes = dict(PRESETS[PRESET_ALIASES.get(args.preset, args.preset)]) if args.preset else {}
    for flag, key in (("hidden", "hidden"), ("inter", "inter"), ("experts", "num_experts"), ("topk", "topk"),
                      ("layers", "layers")):
        if getattr(args, flag) is not None:
            sizes[key] = getattr(args, flag)
    missing = [f"--{k}" for k, key in (("hidden", "hidden"), ("inter", "inter"), ("experts", "num_experts"),
                                       ("topk", "topk")) if key not in sizes]
    if missing:
        print(f"symmring plan: {', '.join(missing)}: expected (or --preset)", file=sys.stderr)
        return 2
    layers = sizes.pop("layers", 1)
    try:
        shape = LayerShape(x_format=args.x_format, expert_format=args.experts_format, **sizes)
        budget = None if args.budget is None else parse_bytes(args.budget)
        ws = plan([shape], world_size=args.ranks, max_tokens=args.max_tokens, budget=budget,
                  tokens_per_slot=args.tokens_per_slot, device=args.device, rdma=args.rdma)
        if layers < 1:
            raise ConfigError(f"--layers={layers}: expected >= 1")
    except ConfigError as exc:
        print(f"symmring plan: {exc}", file=sys.stderr)
        return 2
    lines = ws.table()
    print("\n".join(lines[:-1]))
    print(f"layers     {layers} MoE layer(s) share it (one workspace per layer would take {layers * ws.total} "
          f"bytes, {layers * ws.total / 2**30:.1f} GiB)")
    print(lines[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
