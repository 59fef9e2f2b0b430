"""Command line: ``python -m symmring [-v] {demo,info,bench} ...`` (also installed as ``symmring``).

* ``demo``: the main job: a small MoE layer, batch-ready and streamed, checked against the reference;
  GPU backend where one is usable, CPU backend otherwise. Last line ``demo: PASS ...``/``demo: FAIL ...``.
* ``info``: versions, the backend ``auto`` would pick, devices, ``SYMMRING_*`` variables.
* ``plan``: the bytes per PE of the MoE workspace (`symmring.moe.workspace_plan`), by region, for a model's sizes.
* ``bench NAME``: benchmarks (`BENCHMARKS`); each prints a table and can write ``--json PATH``.

``-v``/``--verbose`` (anywhere before a ``--``) shows symmring's INFO log lines on stderr, ``-vv`` DEBUG
(`symmring.env.configure_logging`; ``SYMMRING_LOG_LEVEL`` does the same). A command that needs an
optional dependency that is missing says so in one line, naming the extra that brings it.
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional, Tuple

#: Commands: module with ``main(argv) -> int``, and the line of the top-level help.
COMMANDS = {
    "demo": ("symmring.demo", "run a small MoE layer batch-ready and streamed; check both against the reference"),
    "info": ("symmring.info", "print versions, the backend auto would pick and why, devices, settings"),
    "plan": ("symmring.plan", "bytes per PE of the MoE workspace by region, and the window a budget implies"),
    "bench": ("symmring.bench", "run a benchmark (GPU): bench NAME [--json PATH]; see below"),
}

#: Benchmarks of ``bench NAME``: module with ``main(argv) -> int``.
BENCHMARKS = {
    "protocol": "symmring.bench.protocol",
    "moe": "symmring.bench.moe",
    "stream": "symmring.bench.stream",
    "gemm": "symmring.bench.gemm",
}
#: One line of help per benchmark.
BENCHMARK_HELP = {
    "protocol": "publish->observe latency; slot-pull vs copy bandwidth",
    "moe": "the GPU MoE layer vs plain torch, per-stage times",
    "stream": "streamed vs batch-ready, the policy table, a timeline PNG",
    "gemm": "expert GEMM engines",
}
#: Entry points that are modules of their own.
OTHER_ENTRY_POINTS = (
    ("python -m symmring.launch", "start a job: ranks pinned to their node's GPUs, CUDA MPS, the GPU environment"),
    ("python -m symmring.modelcheck", "the protocol model checker (--quick: the CI size)"),
    ("python -m symmring.jit", "compile every device module into the cache"),
)
VERBOSE_FLAGS = {"-v": 1, "--verbose": 1, "-vv": 2}


def _benchmark_help(name: str) -> str:
    from . import deps
    present = deps.installed(BENCHMARKS[name])
    return BENCHMARK_HELP[name] + ("" if present else " (not in this version yet)")


def _usage() -> str:
    lines = ["usage: python -m symmring [-v|-vv] COMMAND [ARGS...]   (also installed as `symmring`)", "",
             "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items() if name != "bench"]
    lines += [f"  {'bench ' + name:<16} {_benchmark_help(name)}" for name in BENCHMARKS]
    lines += ["", "options:",
              f"  {'-v, --verbose':<16} symmring's INFO log lines on stderr (-vv: DEBUG; or SYMMRING_LOG_LEVEL)",
              f"  {'-h, --help':<16} this help; COMMAND --help: the command's", "", "other entry points:"]
    lines += [f"  {name:<30} {help_}" for name, help_ in OTHER_ENTRY_POINTS]
    return "\n".join(lines)


def _bench_usage() -> str:
    lines = ["usage: python -m symmring bench NAME [--json PATH] [ARGS...]   (NAME --help: its options)", "",
             "benchmarks (GPU):"]
    lines += [f"  {name:<10} {_benchmark_help(name)}" for name in BENCHMARKS]
    return "\n".join(lines)


def split_verbosity(argv: List[str]) -> Tuple[int, List[str]]:
    """``(verbosity, argv without -v/-vv/--verbose)``; flags after a ``--`` are left alone.

    Example:
        >>> split_verbosity(["-v", "demo", "--tokens", "8", "-v", "--", "-v"])
        (2, ['demo', '--tokens', '8', '--', '-v'])
    """
    verbosity, rest = 0, []
    for idx, arg in enumerate(argv):
        if arg == "--":
            return verbosity, rest + argv[idx:]
        if arg in VERBOSE_FLAGS:
            verbosity += VERBOSE_FLAGS[arg]
        else:
            rest.append(arg)
    return verbosity, rest


def _run(command: str, module_name: str, argv: List[str]) -> int:
    """``module_name.main(argv)``; an optional dependency that is missing is one line, exit status 2."""
    from . import deps
    try:
        module = importlib.import_module(module_name)
        return int(module.main(argv) or 0)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == module_name:
            print(f"symmring {command}: not in this version of symmring ({module_name} is missing)", file=sys.stderr)
            return 2
        if deps.extra_of(missing) is None:
            raise
        print(f"symmring {command}: {deps.hint(missing)}", file=sys.stderr)
        return 2


def main(argv: Optional[List[str]] = None) -> int:
    verbosity, argv = split_verbosity(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    from . import env
    from .errors import ConfigError
    try:
        env.configure_logging(verbosity)
    except ConfigError as exc:
        print(f"symmring: {exc}", file=sys.stderr)
        return 2
    if command == "bench":
        if rest[:1] in (["-h"], ["--help"]):
            print(_bench_usage())
            return 0
        if not rest or rest[0] not in BENCHMARKS:
            what = f"unknown benchmark {rest[0]!r}\n\n" if rest else ""
            print(what + _bench_usage(), file=sys.stderr)
            return 2
        return _run(f"bench {rest[0]}", BENCHMARKS[rest[0]], rest[1:])
    return _run(command, COMMANDS[command][0], rest)


if __name__ == "__main__":
    sys.exit(main())
