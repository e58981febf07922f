"""``python -m demind.features``: the command is :mod:`demind.cli.features` (also ``demind-features``).

An entry point of its own, so that the library module never imports the command line (a
``__main__`` guard in ``demind/features/__init__.py`` made ``demind.cli.features`` and
``demind.features`` import each other)."""

import sys

from demind.cli.features import main

if __name__ == "__main__":
    sys.exit(main())
