#!/usr/bin/env bash
# One-GPU check of the Triton path (issue 14): benchmarks/gpu_check.sh --out FILE [--dry-run]
# Runs from the repository root with src/ on PYTHONPATH; PYTHON overrides the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
