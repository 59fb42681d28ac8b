#!/usr/bin/env bash
# Install FusionNode into the current Python environment (use a venv if you like).
#   ./install.sh         the daemon and CLI
#   ./install.sh --dev   plus the test tools (pytest, hypothesis, ruff)
# torch: an installed torch (your own CUDA build, say) is kept. Only when none is
# installed does this pick torch==2.13.0, the CPU build on machines that carry it.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "install.sh: FusionNode needs Python 3.11 or newer; $PY is $("$PY" -V 2>&1). Set PYTHON=python3.11 (or newer)." >&2
  exit 2
fi
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "install.sh: no torch found; installing torch==2.13.0" >&2
  "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
"$PY" -m pip install -q --disable-pip-version-check -e ".${extra}"
echo "install.sh: fusionnode installed ($("$PY" -c 'import torch; print("torch", torch.__version__)'))" >&2
