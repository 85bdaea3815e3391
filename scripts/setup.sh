#!/usr/bin/env bash
# Set up a virtual environment with kvgate, its test tools and both routers (smg, sglang-router 0.3.2).
# Usage: scripts/setup.sh [VENV_DIR]   (default .venv). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kvgate needs Python >= 3.11")'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -e ".[test]"
touch "$VENV/.installed"
echo "setup: $VENV ready ($("$VENV/bin/python" --version); smg $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("smg"))'))"
