#!/usr/bin/env bash
# One device call for the host path: the GPU tests of the launch paths, the host time per op call
# (host_breakdown.py) and a BERT step's host time (model_report.py --host); logs and JSON to $OUT.
#   bash benchmarks/host_round.sh [tests] [breakdown] [report] [models]
set -u
OUT=${OUT:-/tmp/host_round}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
for part in "$@"; do
    echo "== $part"
    t0=$(date +%s)
    case $part in
        tests) timeout 300 $PY -m pytest -q -m gpu -n 8 --timeout 280 -p no:cacheprovider -rfE \
                   tests/codegen/test_template_gpu.py tests/test_ops.py tests/e2e/test_gpu_models.py 2>&1 | tail -15 ;;
        breakdown) timeout 200 $PY benchmarks/host_breakdown.py --shapes gpt2,bert,llama --policies dense,dfss \
                       --iters 50 --json "$OUT/host_breakdown.json" 2>&1 | tail -40 ;;
        report) timeout 200 $PY benchmarks/model_report.py --model bert --policy dense --host --no-profile 2>&1 \
                    | grep -v Warning | tail -45 ;;
        models) cp benchmarks/results/models_h100.json "$OUT/" 2>/dev/null
                timeout 400 $PY benchmarks/models.py --only ${MODELS:-gpt2,bert} --modes infer --policies dense,dfss \
                    --iters ${ITERS:-50} --json "$OUT/models_h100.json" 2>&1 | grep -v Warning | tail -25 ;;
    esac
    echo "== $part done in $(( $(date +%s) - t0 ))s"
done
