#!/usr/bin/env bash
# Installs SCOUT into the active Python environment: scout-core, and with the frameworks (the default) the
# plugins and the framework releases they are tested with. What nox's sessions (and so CI, in a fresh virtual
# environment), docker/Dockerfile.cpu and docker/Dockerfile.cuda run.
#
#   docker/install.sh [--extras EXTRAS] [--core-only] [--no-editable]
#
# torch is never upgraded: constraints.txt pins it (PIP_CONSTRAINT also reaches isolated build environments), so a
# CPU machine never pulls a CUDA build and a CUDA image keeps its own torch of that release (a local version label
# such as +cu128 satisfies the pin).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="dev"
FRAMEWORKS=1
EDITABLE=(-e)
while [ $# -gt 0 ]; do
  case "$1" in
    --extras) EXTRAS="$2"; shift 2 ;;
    --core-only) FRAMEWORKS=0; shift ;;
    --no-editable) EDITABLE=(); shift ;;
    *) echo "install.sh: unknown argument $1 (--extras EXTRAS, --core-only, --no-editable)" >&2; exit 2 ;;
  esac
done

TORCHTITAN="torchtitan==0.3.0"     # the TorchTitan release scout-torchtitan is tested with
MEGATRON_CORE="megatron-core==0.19.2"  # the Megatron-Core release scout-megatron is tested with

export PIP_CONSTRAINT="${PIP_CONSTRAINT:-$ROOT/constraints.txt}"
pip() { python -m pip install --disable-pip-version-check "$@"; }

core="$ROOT"
[ -n "$EXTRAS" ] && core="$ROOT[$EXTRAS]"
pip ${EDITABLE[@]+"${EDITABLE[@]}"} "$core"
[ "$FRAMEWORKS" = 1 ] || exit 0

# TorchTitan, without its declared dependencies (they admit a newer torch), after the modules it imports.
pip -r "$ROOT/plugins/scout-torchtitan/requirements.txt"
pip --no-deps "$TORCHTITAN"
pip --no-deps ${EDITABLE[@]+"${EDITABLE[@]}"} "$ROOT/plugins/scout-torchtitan"

# megatron-core 0.19 declares Python >= 3.12 but ships 3.11 wheels: it goes in alone with --no-deps
# --ignore-requires-python (on a shared line that flag makes pip choose numpy builds meant for 3.12), after the
# modules it imports.
pip -r "$ROOT/plugins/scout-megatron/requirements.txt"
pip --no-deps --ignore-requires-python "$MEGATRON_CORE"
pip --no-deps ${EDITABLE[@]+"${EDITABLE[@]}"} "$ROOT/plugins/scout-megatron"

# DeepSpeed builds from its sdist: torch (installed, pinned) must be visible to its setup.py
# (--no-build-isolation), and none of its kernels is compiled here (DS_BUILD_OPS=0: on a GPU, on first use).
pip "setuptools>=69" wheel
DS_BUILD_OPS=0 pip --no-build-isolation -r "$ROOT/plugins/scout-deepspeed/requirements.txt"
pip --no-deps ${EDITABLE[@]+"${EDITABLE[@]}"} "$ROOT/plugins/scout-deepspeed"

# Hugging Face transformers and Accelerate (scout-hf), pinned in the plugin's requirements, torch held by the
# constraint.
pip -r "$ROOT/plugins/scout-hf/requirements.txt"
pip --no-deps ${EDITABLE[@]+"${EDITABLE[@]}"} "$ROOT/plugins/scout-hf"

# PyTorch Lightning (scout-lightning), pinned in the plugin's requirements, torch held by the constraint.
pip -r "$ROOT/plugins/scout-lightning/requirements.txt"
pip --no-deps ${EDITABLE[@]+"${EDITABLE[@]}"} "$ROOT/plugins/scout-lightning"
