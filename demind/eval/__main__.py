"""``python -m demind.eval --benchmark ... --data-root ... --out ...`` (see demind.eval.cli)."""

from demind.eval.cli import main

if __name__ == "__main__":
    main()
