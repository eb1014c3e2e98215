#!/usr/bin/env bash
# kvpress 0.5.5 in its own virtual environment, for the parity check of `evalkit-report export kvpress`
# (tests/test_results_travel.py, -m slow): the library, what its evaluation scripts import (its `eval` extra: the
# scorers' packages; fire) and those scripts, which only its sdist ships, copied to VENV/kvpress-evaluation.
#
#     bash benchmarks/kvpress_venv.sh [VENV]     # default /tmp/kvpress-venv; the test reads EVALKIT_KVPRESS_VENV
set -euo pipefail
venv=${1:-/tmp/kvpress-venv}
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0  # first: the CPU build, so that kvpress does not pull a CUDA one
"$venv/bin/pip" install -q "kvpress[eval]==0.5.5" fire
sdist=$(mktemp -d)
trap 'rm -rf "$sdist"' EXIT
"$venv/bin/pip" download -q --no-binary :all: --no-deps kvpress==0.5.5 -d "$sdist"
tar -xzf "$sdist/kvpress-0.5.5.tar.gz" -C "$sdist"
rm -rf "$venv/kvpress-evaluation"
cp -r "$sdist/kvpress-0.5.5/evaluation" "$venv/kvpress-evaluation"
cd "$venv/kvpress-evaluation" && "$venv/bin/python" -c "import evaluate, evaluate_registry" && echo "kvpress ready: $venv"
