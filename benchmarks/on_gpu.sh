#!/usr/bin/env bash
# The runs made on a lent GPU machine (JAX with CUDA, torch and transformers preinstalled; no
# network), one stage per command so each fits the lease's 10-minute limit. Everything a stage
# produces lands in $OUT (default gpu_out/): logs, tables (BENCHMARKS_gpu.md, merged into
# docs/BENCHMARKS.md afterwards) and run artefacts.
#
#   bash benchmarks/on_gpu.sh check    # env, compiled-kernel tests, training probe, int8 table, suite
#   bash benchmarks/on_gpu.sh train    # the sink-token twins at the gpu-6m recipe (STEPS=...)
#   bash benchmarks/on_gpu.sh bench    # end-to-end decode/prefill tables
set -u
STAGE=${1:?stage: check, train or bench}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAXLLM_BENCHMARKS_MD=$OUT/BENCHMARKS_gpu.md
PY=${PY:-python3}
T0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }  # seconds left in this command
step() { echo "== $* ($(( $(date +%s) - T0 )) s)"; }

case $STAGE in
check)
  step env
  { nvidia-smi; $PY -c "import jax; print('jax', jax.__version__, jax.devices())";
    $PY -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|flax|optax|orbax|transformers|torch|triton|pytest|numpy) "; } \
    > "$OUT/env.txt" 2>&1
  step "compiled Pallas kernels (pytest -m gpu)"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 $PY -m pytest -m gpu tests/test_pallas.py -q \
    -p no:cacheprovider -rf > "$OUT/pytest_gpu.log" 2>&1; tail -3 "$OUT/pytest_gpu.log"
  step "training probe: the three variants at once, gpu-6m, 300 steps"
  timeout 170 $PY -m train.experiments.sink_token --preset gpu-6m --set steps=300 \
    --set log_every=50 --set sink_eval_every=150 --out /tmp/probe --parallel --train-only \
    > "$OUT/train_probe.log" 2>&1
  for v in none zero learnable; do echo "-- $v"; cat /tmp/probe/$v/metrics.jsonl;
    tail -5 /tmp/probe/$v/train.log; done >> "$OUT/train_probe.log" 2>&1
  cat /tmp/probe/.token_cache/*.json >> "$OUT/train_probe.log" 2>/dev/null
  tail -4 "$OUT/train_probe.log"
  step "int8 matmul table"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 130 $PY benchmarks/int8_matmul.py \
    > "$OUT/int8_matmul.log" 2>&1; tail -3 "$OUT/int8_matmul.log"
  step "the whole suite on the GPU"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $(( $(left) - 15 )) $PY -m pytest -n 8 -q \
    -p no:cacheprovider --durations=20 -rf > "$OUT/pytest_full.log" 2>&1
  tail -40 "$OUT/pytest_full.log"
  ;;
train)
  # The three variants at once (one process each), STEPS sized to the command's time limit;
  # each finished run comes back as one archive: its model in bfloat16, metrics, config, the
  # held-out text and the corpus manifest (evaluated afterwards on any machine).
  step "sink-token twins, gpu-6m, ${STEPS:?} steps"
  timeout $(( $(left) - 40 )) $PY -m train.experiments.sink_token --preset gpu-6m \
    --set steps=$STEPS --set sink_eval_every=${PROBE_EVERY:-500} --out /tmp/sinks --parallel \
    --train-only 2>&1 | tee "$OUT/train.log"
  for v in none zero learnable; do
    [ -d /tmp/sinks/$v/model ] && $PY -c "import sys, jax, jax.numpy as jnp, jaxllm
cfg, p, _ = jaxllm.load_model(sys.argv[1])
jaxllm.save_model(sys.argv[2], cfg, jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))" \
      /tmp/sinks/$v/model /tmp/sinks/$v/model_bf16
    (cd /tmp/sinks && tar czf "$OUT/run_$v.tgz" --exclude=checkpoints --exclude=model $v)
  done
  ls -la "$OUT"
  ;;
final)
  # After the fixes the first check called for: XLA's int8 dot, the compiled kernels, the tests
  # that failed there (FAILED=file of node ids), the int8 table, a first decode-latency table.
  step "XLA int8 dot_general exactness"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 $PY benchmarks/xla_int8_check.py \
    > "$OUT/xla_int8_check.log" 2>&1; cat "$OUT/xla_int8_check.log" | tail -6
  step "compiled kernels and the TF32 check (pytest -m gpu)"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 $PY -m pytest -m gpu tests/test_pallas.py \
    tests/test_model.py -q -p no:cacheprovider -rf > "$OUT/pytest_gpu.log" 2>&1
  tail -4 "$OUT/pytest_gpu.log"
  if [ -n "${FAILED:-}" ]; then
    step "the tests that failed in the first GPU run"
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 $PY -m pytest -n 14 -q -p no:cacheprovider \
      --durations=10 -rf "@$FAILED" > "$OUT/pytest_rerun.log" 2>&1; tail -25 "$OUT/pytest_rerun.log"
  fi
  step "int8 matmul table"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 130 $PY benchmarks/int8_matmul.py \
    > "$OUT/int8_matmul.log" 2>&1; tail -8 "$OUT/int8_matmul.log"
  step "decode latency, pythia-160m bf16, cache 4096"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $(( $(left) - 10 )) $PY benchmarks/latency.py \
    --model random:pythia-160m --sizes 4096 --dtype bfloat16 --rounds 2 --tokens 32 \
    --recompute-tokens 2 > "$OUT/latency.log" 2>&1; tail -6 "$OUT/latency.log"
  ;;
*) echo "unknown stage $STAGE"; exit 2;;
esac
step done
