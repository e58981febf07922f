"""``python -m demind.eval``: the command is :mod:`demind.cli.evaluate` (also ``demind-eval``)."""

import sys

from demind.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
