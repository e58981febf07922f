#!/usr/bin/env bash
# Set up (or update) the project's virtual environment in .venv. Safe to rerun.
# torch/torchvision are pinned first: open_clip needs torchvision, and these two
# releases install from local disk on the project's build machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
.venv/bin/python -m pip install -q -e '.[train,gen,test]'
echo "demind: environment ready in .venv"
