#!/usr/bin/env bash
# Install megarl and its test extras on a CPU machine. Idempotent: a second run
# installs nothing. torch is installed first at a CPU build when no torch is
# present, so the unpinned `torch` in pyproject does not pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
"$PYTHON" -m pip install --quiet -e ".[test]"
# pyenv installs console scripts behind shims that need a rehash to appear.
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
