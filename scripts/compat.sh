#!/usr/bin/env bash
# Declared floors are tested floors: install the *lowest* versions pyproject.toml admits of
# open_clip_torch, transformers, accelerate, webdataset, huggingface_hub and datasets into a scratch
# virtual environment and run the tests that exercise them (CLIP loading and the text tower,
# checkpoints and feature caches, generation with the tiny LLaVA and its chat templates, the training
# smoke run, kill and resume, DeepSpeed's refusal where it is not installed, shards, Hub publishing
# and hf-hub: loading). Not part of CI: it installs old releases (about 4 min the first time, 1.5 min
# after, on the 2-core build machine).
#
#   bash scripts/compat.sh                       # the floors declared in pyproject.toml
#   OPEN_CLIP=2.26.1 bash scripts/compat.sh      # try another version of one package
#   COMPAT_VENV=/somewhere/else bash scripts/compat.sh
#
# The environment lives in .compat-venv (ignored by git) and is reused: each run installs the
# asked-for versions over it. The last line is the pytest summary; record it in BENCHMARKS.md
# ("Compatibility floors") with the date when a floor changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${COMPAT_VENV:-.compat-venv}

# The lowest version pyproject.toml declares for a package (over the dependencies and every extra).
floor() {
    "$PYTHON" - "$1" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
requirements = list(project["dependencies"])
for extra in project.get("optional-dependencies", {}).values():
    requirements += extra
floors = [m.group(1) for r in requirements if (m := re.fullmatch(rf"{re.escape(sys.argv[1])}\s*>=\s*([\w.]+)", r.strip()))]
if not floors:
    sys.exit(f"pyproject.toml declares no floor ('{sys.argv[1]}>=X') for {sys.argv[1]}")
print(min(floors, key=lambda v: tuple(int(p) for p in re.findall(r"\d+", v))))
EOF
}

OPEN_CLIP=${OPEN_CLIP:-$(floor open_clip_torch)}
TRANSFORMERS=${TRANSFORMERS:-$(floor transformers)}
ACCELERATE=${ACCELERATE:-$(floor accelerate)}
WEBDATASET=${WEBDATASET:-$(floor webdataset)}
HUB=${HUB:-$(floor huggingface_hub)}
DATASETS=${DATASETS:-$(floor datasets)}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# torch/torchvision as scripts/setup.sh pins them; the four packages under test at their floors;
# then the rest of what the tests import, at whatever version pip picks.
"$PY" -m pip install -q torch==2.14.1 torchvision==0.29.1
"$PY" -m pip install -q "open_clip_torch==$OPEN_CLIP" "transformers==$TRANSFORMERS" \
    "accelerate==$ACCELERATE" "webdataset==$WEBDATASET" "huggingface_hub==$HUB" "datasets==$DATASETS" \
    timm safetensors pyyaml tqdm pillow numpy matplotlib tensorboard pot "pytest>=7"
# The project itself without dependencies, so nothing above is upgraded behind our back; installed
# (not only on PYTHONPATH) because the toy image tower is found through its entry point.
"$PY" -m pip install -q --no-deps -e .

echo "compat: $("$PY" - <<'EOF'
from importlib.metadata import version
print(", ".join(f"{p} {version(p)}" for p in ("torch", "open_clip_torch", "transformers", "accelerate", "webdataset", "huggingface_hub", "datasets")))
EOF
)"
exec "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_backbone.py tests/test_clip_loading.py tests/test_checkpoint.py tests/test_features.py tests/test_shard_format.py \
    tests/test_data_gen.py tests/test_gen_memory.py tests/test_train.py tests/test_train_resume.py \
    tests/test_deepspeed.py tests/test_hub.py "$@"
