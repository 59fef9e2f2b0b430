"""Ratios of two ``python -m symmring bench moe --json`` runs made in one device call (new / previous).

Usage: ``python tools/compare_bench.py NEW.json PREV.json [--bound 1.10]``

For every (shape, engine, transport, tokens per rank) row in both files it prints the eager latency
(``layer_ms``: the graph cache on), the graph replay latency (``layer_graph_ms``) and their ratios, then
``compare: PASS`` when every graph ratio is within ``--bound`` (the eager ones too with ``--eager``), else
``compare: FAIL`` naming the rows past it. Exit status 0 either way: the figures are the result.
"""

from __future__ import annotations

import argparse
import json
import sys


def rows(path: str):
    with open(path) as f:
        data = json.load(f)
    return {(r["shape"], r["engine"], r.get("transport", "p2p"), r["tokens_per_rank"]): r for r in data["rows"]}, data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("new")
    parser.add_argument("prev")
    parser.add_argument("--bound", type=float, default=1.10)
    parser.add_argument("--eager", action="store_true", help="hold the eager ratios to the bound too")
    args = parser.parse_args(argv)
    new, new_data = rows(args.new)
    prev, _ = rows(args.prev)
    print(f"world_size {new_data.get('world_size')}; new / previous (ms)")
    print(f"{'shape':<15} {'engine':<8} {'tokens':>6} {'eager new':>10} {'prev':>8} {'ratio':>6} "
          f"{'graph new':>10} {'prev':>8} {'ratio':>6}")
    misses = []
    for key in sorted(set(new) & set(prev), key=lambda k: (k[0], k[1], k[2], k[3])):
        n, p = new[key], prev[key]
        eager = n["layer_ms"] / p["layer_ms"]
        graph = None
        if n.get("layer_graph_ms") and p.get("layer_graph_ms"):
            graph = n["layer_graph_ms"] / p["layer_graph_ms"]
        g = f"{n['layer_graph_ms']:>10.4f} {p['layer_graph_ms']:>8.4f} {graph:>6.3f}" if graph else f"{'-':>26}"
        print(f"{key[0]:<15} {key[1]:<8} {key[3]:>6} {n['layer_ms']:>10.4f} {p['layer_ms']:>8.4f} {eager:>6.3f} {g}")
        if graph is not None and graph > args.bound:
            misses.append(f"{key[0]} {key[3]} tokens graph {graph:.3f}")
        if args.eager and eager > args.bound:
            misses.append(f"{key[0]} {key[3]} tokens eager {eager:.3f}")
    print("compare: PASS" if not misses else "compare: FAIL (" + "; ".join(misses) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
