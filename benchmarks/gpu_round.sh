#!/usr/bin/env bash
# One GPU round: the GPU tests and the benchmarks of benchmarks/README.md, in parts that each run under
# their own time limit, so that a device call (10 minutes at most) runs several of them and a part that
# hangs costs only its own limit. Logs and JSON go to $OUT (at most 8 files come back from a device call:
# one log, and the results files).
#
#   bash benchmarks/gpu_round.sh PART[:SECONDS] ...
#
# Parts: env, tests, pytest (the selection in $PYTEST_ARGS), spion (SPION pattern timing), tvm (needs cubins built on a CPU machine: python -m attncomp build-kernels --arch sm_90
# --head-dim 64 --out build/tvm-cubins), checks (SDPA backend check, host overhead, SPION patterns),
# models, kernels (dense/dfss/hash/drop table), structured (predicate and SPION rows), tvmbench, hopper
# (the Hopper variants of benchmarks/hopper.py: TMA, atomic dQ, the DFSS breakdown), gluon (the Gluon forward and
# dK/dV pass against cuDNN: gluon_fwd.py, gluon_bwd.py), breakdown (host time
# per op call, host_breakdown.py), report (BERT's host and kernels per step against torch.compile).
set -u
OUT=${OUT:-/tmp/gpu_round}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export ATTNCOMP_TVM_CUBINS=${ATTNCOMP_TVM_CUBINS:-build/tvm-cubins}
PY=${PY:-python3}
LOG="$OUT/round.log"
GPU=$($PY -c "import torch; n=torch.cuda.get_device_name().lower(); print(next((g for g in ('h200','h100') if g in n), 'gpu'))" 2>/dev/null || echo gpu)
TESTS="tests/codegen/test_triton_gpu.py tests/codegen/test_scfa_gpu.py tests/codegen/test_template_gpu.py
       tests/e2e/test_gpu_models.py tests/test_ops.py tests/codegen/test_spion_stats_gpu.py tests/codegen/test_hopper_gpu.py"

run_part() {
    local name=$1
    case $name in
        env) nvidia-smi -L; $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" ;;
        tests) $PY -m pytest -q -m gpu -n 8 --timeout 600 -p no:cacheprovider -rfE $TESTS ;;
        pytest) $PY -m pytest -q -p no:cacheprovider -rfE ${PYTEST_ARGS:-} ;;
        spion) $PY benchmarks/spion_patterns.py --json "$OUT/spion_patterns_$GPU.json" ;;
        tvm) $PY -m pytest -q -m gpu --timeout 600 -p no:cacheprovider -rfE tests/codegen/test_tvm_gpu.py ;;
        checks) $PY benchmarks/sdpa_gpu_check.py && $PY benchmarks/host_overhead.py --device cuda --iters 200 &&
                $PY benchmarks/spion_patterns.py --json "$OUT/spion_patterns_$GPU.json" ;;
        models) [ -f "benchmarks/results/models_$GPU.json" ] && cp "benchmarks/results/models_$GPU.json" "$OUT/"
                $PY benchmarks/models.py --json "$OUT/models_$GPU.json" ${MODELS_ARGS:-} ;;
        kernels) $PY benchmarks/attention.py --tune --out "$OUT/attention_$GPU.json" ${KERNELS_ARGS:-} ;;
        structured) $PY benchmarks/attention.py --table structured ${STRUCTURED_ARGS:-} ;;
        hopper) $PY benchmarks/hopper.py --out "$OUT/hopper_$GPU.json" ${HOPPER_ARGS:-} ;;
        gluon) $PY benchmarks/gluon_fwd.py --out "$OUT/gluon_fwd_$GPU.json" ${GLUON_FWD_ARGS:-} &&
               $PY benchmarks/gluon_bwd.py --out "$OUT/gluon_bwd_$GPU.json" ${GLUON_BWD_ARGS:-} ;;
        breakdown) $PY benchmarks/host_breakdown.py --shapes ${BREAKDOWN_SHAPES:-tiny,gpt2,bert,llama} --policies ${BREAKDOWN_POLICIES:-eager,dense,dfss,hash,drop} --iters 50 \
                       --json "$OUT/host_breakdown_$GPU.json" ;;
        report) $PY benchmarks/model_report.py --model bert --policy dense --host --kernels --no-profile ;;
        tvmbench) $PY benchmarks/attention_tvm.py --device cuda --cubins "$ATTNCOMP_TVM_CUBINS" --ns 1024,4096 \
                      --out "$OUT/attention_tvm_$GPU.json" ;;
        *) echo "unknown part $name"; return 2 ;;
    esac
}

export -f run_part
export OUT PY GPU TESTS
status=0
for arg in "$@"; do
    name=${arg%%:*}
    limit=${arg#*:}
    [ "$limit" = "$arg" ] && limit=300
    echo "== $name (limit ${limit}s)" | tee -a "$LOG"
    t0=$(date +%s)
    timeout -k 10 "$limit" bash -c 'run_part "$1"' _ "$name" > "$OUT/part.log" 2>&1
    rc=$?
    cat "$OUT/part.log" >> "$LOG"
    echo "== $name rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$LOG"
    tail -n 25 "$OUT/part.log"
    [ $rc -ne 0 ] && status=1
done
rm -f "$OUT/part.log"
exit $status
