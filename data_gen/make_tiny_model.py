"""A tiny random LLaVA-NeXT for CPU smoke runs: ``python data_gen/make_tiny_model.py --output DIR``.

The command is :mod:`demind.cli.make_tiny_model`.
"""

import sys

from demind.cli.make_tiny_model import main

if __name__ == "__main__":
    sys.exit(main())
