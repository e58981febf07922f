"""Intent-data generation: ``python data_gen/run.py --input ... --output ... [--config ...]``.

The command is :mod:`demind.cli.generate` (also installed as ``demind-generate``).
"""

import sys

from demind.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
