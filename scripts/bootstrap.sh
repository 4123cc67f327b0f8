#!/usr/bin/env bash
# Creates .venv and installs lora-guard with its extras. Safe to run again: it returns at once when
# nothing changed since the last run.
#   PYTHON=python3.11      interpreter that creates the venv (default: python3)
#   TORCH_SPEC="torch==X"  install this torch instead of the default CPU build
#   VENV=path              where the venv lives (default: .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
DEFAULT_TORCH="torch==2.13.0"
EXTRAS=${EXTRAS:-dev,demo}

stamp_file="$VENV/.lora-guard-bootstrap"
stamp="$(cat pyproject.toml; echo "torch=${TORCH_SPEC:-default} extras=$EXTRAS")"
stamp=$(printf '%s' "$stamp" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] && [ -x "$VENV/bin/lora-guard" ]; then
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    if [ -z "${TORCH_SPEC:-}" ] && "$PYTHON" -c "import torch" 2>/dev/null; then
        echo "bootstrap: using the torch that $PYTHON already has"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

if [ -n "${TORCH_SPEC:-}" ]; then
    echo "bootstrap: installing $TORCH_SPEC"
    "${pip[@]}" "$TORCH_SPEC"
elif ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "bootstrap: installing $DEFAULT_TORCH"
    "${pip[@]}" "$DEFAULT_TORCH"
fi

echo "bootstrap: installing lora-guard[$EXTRAS]"
"${pip[@]}" -e ".[$EXTRAS]"
"$VENV/bin/python" -c "import torch, lora_guard; print('bootstrap: torch', torch.__version__, '| lora-guard', lora_guard.__version__)"
# The engine's compiled operations (the LoRA kernel, the layers' small operations), built now
# rather than at the engine's first start; without a C++ compiler the engine computes with
# torch's operations instead, so a failure here stops nothing.
"$VENV/bin/python" -c "import sys; from lora_guard.engine import native; sys.exit(native.main())" ||
    echo "bootstrap: the compiled operations were not built; the engine will use torch's"
printf '%s' "$stamp" >"$stamp_file"
