#!/usr/bin/env bash
# Set up (or update) the project's virtual environment in .venv. Safe to rerun.
# `bash scripts/setup.sh --vllm` sets up .venv-vllm instead (vLLM's CPU build; see docs/generation.md).
# torch/torchvision are pinned first: open_clip needs torchvision, and these two
# releases install from local disk on the project's build machines.
set -euo pipefail
cd "$(dirname "$0")/.."
# --vllm: (only) set up .venv-vllm, vLLM's CPU build beside the project (scripts/setup_vllm.sh)
if [ "${1:-}" = "--vllm" ]; then exec bash scripts/setup_vllm.sh; fi
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
# distributed (Ray, ~240 MB, ~11 s to install) is in so that the Ray generation tests run here too
.venv/bin/python -m pip install -q -e '.[train,gen,test,search,robust,hub,distributed]'
# The search page's test drives a real headless Chromium (Debian's package). Installed when we
# are root with apt and it is missing; elsewhere that one test skips and says how to install it.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
   && [ "${DEMIND_SKIP_BROWSER:-0}" != 1 ]; then
    (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) \
        || echo "demind: could not install chromium; the browser test will skip"
fi
echo "demind: environment ready in .venv"
