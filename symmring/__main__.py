"""Command line: ``python -m symmring {demo,info,bench} ...`` (also installed as ``symmring``).

* ``demo``: the main job: a small MoE layer, batch-ready and streamed, checked against the reference;
  GPU backend where one is usable, CPU backend otherwise. Last line ``demo: PASS ...``/``demo: FAIL ...``.
* ``info``: versions, the backend ``auto`` would pick, devices, ``SYMMRING_*`` variables.
* ``bench NAME``: benchmarks (``protocol``); each prints a table and can write ``--json PATH``.
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional

COMMANDS = {
    "demo": ("symmring.demo", "run a small MoE layer both ways and check it against the reference"),
    "info": ("symmring.info", "print versions, backend and devices"),
    "bench": ("symmring.bench", "run a benchmark: bench {protocol,moe} [--json PATH]"),
}

#: Benchmarks of ``bench NAME``: module with ``main(argv) -> int``.
BENCHMARKS = {
    "protocol": "symmring.bench.protocol",
    "moe": "symmring.bench.moe",
    "stream": "symmring.bench.stream",
}


def _usage() -> str:
    lines = ["usage: python -m symmring COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<6} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if command == "bench":
        if not rest or rest[0] not in BENCHMARKS:
            print(f"usage: python -m symmring bench {{{','.join(BENCHMARKS)}}} [--json PATH]", file=sys.stderr)
            return 2
        module = importlib.import_module(BENCHMARKS[rest[0]])
        return int(module.main(rest[1:]) or 0)
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
