"""``python -m symmring.modelcheck``: runs `symmring.modelcheck.cli.main`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
