"""Figure lines of the tests (``[figure] ...``: measured errors, times to a typed error, soak counts).

Quiet by default: every figure line goes to a log file, ``$SYMMRING_FIGURE_LOG`` (default
``.pytest_cache/symmring-figures.log`` in the checkout; the outermost pytest run starts it afresh and the
runs it starts under ``mpiexec`` append to it), and appears on the terminal only with ``-s`` or ``-v``
(or ``SYMMRING_FIGURES_SHOW=1``, which tests/test_under_mpi.py sets for its ``mpiexec`` runs, whose output
it collects).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_LOG, ENV_SHOW = "SYMMRING_FIGURE_LOG", "SYMMRING_FIGURES_SHOW"
DEFAULT_LOG = Path(__file__).resolve().parents[1] / ".pytest_cache" / "symmring-figures.log"
_started = False


def log_path() -> Path:
    return Path(os.environ.get(ENV_LOG) or DEFAULT_LOG)


def shown(config) -> bool:
    """Whether figure lines go to the terminal too: ``-s``, ``-v`` or ``SYMMRING_FIGURES_SHOW=1``."""
    return os.environ.get(ENV_SHOW) == "1" or config.getoption("verbose") > 0 or config.getoption("capture") == "no"


def emit(config, line: str) -> None:
    """Append ``line`` to the figure log; print it as well where `shown`."""
    global _started
    path = log_path()
    if not _started:
        _started = True
        if ENV_LOG not in os.environ:  # the outermost run: a fresh log, inherited by the runs it starts
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")
            os.environ[ENV_LOG] = str(path)
    with path.open("a") as log:
        log.write(line.rstrip("\n") + "\n")
    if shown(config):
        capture = config.pluginmanager.get_plugin("capturemanager")
        if capture is None:  # pragma: no cover - pytest run with -p no:capture
            print(line, flush=True)
            return
        with capture.global_and_fixture_disabled():  # what capsys.disabled() does
            print(line, flush=True)
