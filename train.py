"""Train De-MINDS: ``accelerate launch train.py --config configs/train/paper.yaml [a.b=c ...]``.

The command is :mod:`demind.cli.train` (also installed as ``demind-train``).
"""

import sys

from demind.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
