"""The README's main job, the toy-world pipeline on a CPU: ``python pipelines/quickstart.py [overrides]``.

The command is :mod:`toyworld.cli.quickstart` (also installed as ``demind-quickstart``).
"""

import sys

from toyworld.cli.quickstart import main

if __name__ == "__main__":
    sys.exit(main())
