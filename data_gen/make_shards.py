"""Input shards from images + captions: ``python data_gen/make_shards.py --images ... --captions ... --output ...``.

The command is :mod:`demind.cli.make_shards` (also installed as ``demind-make-shards``).
"""

import sys

from demind.cli.make_shards import main

if __name__ == "__main__":
    sys.exit(main())
