#!/usr/bin/env bash
# The runs made on a lent GPU machine (JAX with CUDA, torch and transformers preinstalled; no
# network; the checkout run from PYTHONPATH, not pip-installed). One stage per command, each
# within BUDGET seconds (default 530: a lease allows 10 minutes a command), so a session runs
# them back to back on one warm machine. Everything a stage writes lands in $OUT: the device
# tool sets it to the folder that comes back (at most 8 files of 16 MiB); elsewhere it defaults
# to docs/gpu/<date>-<device>/, where the results are committed.
#
#   bash benchmarks/on_gpu.sh suite     # env.txt and the whole test suite: pytest_full.log
#   bash benchmarks/on_gpu.sh kernels   # compiled Pallas kernels (pytest -m gpu), int8 GEMM table
#   bash benchmarks/on_gpu.sh bench     # decode tables at Llama-2-7B shapes: StreamingLLM vs
#                                       # dense vs recompute, and the KV storage formats
#   bash benchmarks/on_gpu.sh decode    # gpu_decode.py: KV formats at Llama-2-7B, 4+4092, b 1/8,
#                                       # by the stored-format kernel and by the XLA form; each
#                                       # row's top kernels in profile_decode.md (_profile.py)
#   bash benchmarks/on_gpu.sh decode2   # gpu_decode.py: W8A8 / W8 / 4-bit weights, transformers
#   bash benchmarks/on_gpu.sh serve     # serve.py at Llama-2-7B shapes (random weights): pools of
#                                       # 8 and 32 rows of 4+1020, 128 rows of 4+252
#   STEPS=N bash benchmarks/on_gpu.sh train   # the sink-token twins at the gpu-6m recipe
#   STEPS=N bash benchmarks/on_gpu.sh sinks   # the three sink variants at the gpu-sinks recipe
#   (train and sinks: SET="scan_layers=true remat=true" adds recipe overrides)
set -u
STAGE=${1:?stage: suite, kernels, decode, decode2, serve, bench, train or sinks}
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
  | grep -oiE "[A-Z][0-9]{3}" | head -1 | tr 'A-Z' 'a-z')
OUT=${OUT:-docs/gpu/$(date +%F)-${DEVICE:-gpu}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAXLLM_BENCHMARKS_MD=$OUT/BENCHMARKS_gpu.md
PY=${PY:-python3}
T0=$(date +%s)
SETS=$(for o in ${SET:-}; do printf -- '--set %s ' "$o"; done)
left() { echo $(( ${BUDGET:-530} - ($(date +%s) - T0) )); }  # seconds left in this stage
step() { echo "== $* ($(( $(date +%s) - T0 )) s)"; }
# Workers for the suite: one per two cores (each compiles on its own), at most 14.
WORKERS=$(( $(nproc) / 2 < 14 ? $(nproc) / 2 : 14 ))

case $STAGE in
suite)
  step env
  { date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi;
    $PY -c "import jax; print('jax', jax.__version__, jax.devices())";
    $PY -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|flax|optax|orbax|transformers|torch|triton|pytest|pytest-xdist|hypothesis|numpy) "; } \
    > "$OUT/env.txt" 2>&1
  step "the whole suite on the GPU ($WORKERS workers)"
  timeout $(( $(left) - 10 )) $PY -m pytest -n "$WORKERS" -q -p no:cacheprovider \
    --durations=20 -rfs > "$OUT/pytest_full.log" 2>&1
  echo "exit $?" >> "$OUT/pytest_full.log"
  tail -30 "$OUT/pytest_full.log"
  ;;
kernels)
  step "compiled Pallas kernels (pytest -m gpu)"
  timeout 240 $PY -m pytest -m gpu tests/test_pallas.py tests/test_model.py \
    tests/test_attention.py -q \
    -p no:cacheprovider -rf > "$OUT/pytest_gpu.log" 2>&1; tail -3 "$OUT/pytest_gpu.log"
  step "XLA int8 dot_general exactness"
  timeout 60 $PY benchmarks/xla_int8_check.py > "$OUT/xla_int8_check.log" 2>&1
  tail -4 "$OUT/xla_int8_check.log"
  step "int8 matmul table, Llama-2-7B shapes"
  timeout $(( $(left) - 10 )) $PY benchmarks/int8_matmul.py --models llama2-7b \
    > "$OUT/int8_matmul.log" 2>&1; tail -12 "$OUT/int8_matmul.log"
  ;;
decode)
  step "decode ms per step by KV format, llama2-7b shapes, 4+4092 filled by the prompt"
  timeout $(( $(left) - 10 )) $PY benchmarks/gpu_decode.py --out "$OUT" --batch 1,8 \
    --kv bf16,int8,token-4,kivi-2 --weights bf16 --attention pallas,blockwise \
    --profile "$OUT/profile_decode.md" > "$OUT/gpu_decode.log" 2>&1
  tail -12 "$OUT/gpu_decode.log"
  ;;
decode2)
  step "decode by weight format, and transformers' generate on the same GPU"
  mkdir -p "$OUT/weights"
  timeout $(( $(left) - 10 )) $PY benchmarks/gpu_decode.py --out "$OUT/weights" --batch 1,8,32 \
    --kv bf16 --weights bf16,w8a8,w8,w4 --transformers --profile "$OUT/profile_decode2.md" \
    > "$OUT/gpu_decode_weights.log" 2>&1
  tail -12 "$OUT/gpu_decode_weights.log"
  ;;
bench)
  step "decode latency, random:llama2-7b bfloat16, cache 4096: StreamingLLM, dense, recompute"
  timeout 240 $PY benchmarks/latency.py --model random:llama2-7b --sizes 4096 \
    --dtype bfloat16 --rounds 2 --tokens 32 --recompute-tokens 2 > "$OUT/latency.log" 2>&1
  tail -8 "$OUT/latency.log"
  step "decode ms per step by KV storage format, llama2-7b, 4+4064, batch 8"
  timeout $(( $(left) - 10 )) $PY benchmarks/kv_quant.py --skip ppl,bytes \
    --timing-preset llama2-7b --timing-caches 4064 --timing-batch 8 --steps 10 \
    > "$OUT/kv_quant.log" 2>&1
  tail -12 "$OUT/kv_quant.log"
  ;;
train)
  # The three variants at once (one process each), STEPS sized to the stage's time; each
  # finished run comes back as one archive: its model in bfloat16, metrics, config, the
  # held-out text and the corpus manifest (evaluated afterwards on any machine).
  step "sink-token twins, gpu-6m, ${STEPS:?} steps"
  timeout $(( $(left) - 40 )) $PY -m train.experiments.sink_token --preset gpu-6m \
    --set steps=$STEPS --set sink_eval_every=${PROBE_EVERY:-500} $SETS --out /tmp/sinks --parallel \
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
sinks)
  # The gpu-sinks recipe (train/config.py), the three variants at once, STEPS per command
  # (default: the recipe's 1B tokens); a second command with a larger STEPS on the same warm
  # machine resumes from /tmp/gpu_sinks. Each run comes back as an uncompressed tar in pieces
  # of at most 15 MiB (cat run_V.tar.* > run_V.tar): its model in bfloat16 shards, metrics
  # (MFU against the measured bf16 matmul rate), config, held-out text and corpus manifest.
  step "sink variants, gpu-sinks, ${STEPS:-3815} steps"
  timeout $(( $(left) - 60 )) $PY -m train.experiments.sink_token --preset gpu-sinks \
    --set steps=${STEPS:-3815} $SETS --out /tmp/gpu_sinks --parallel --train-only \
    > "$OUT/train_sinks.log" 2>&1
  tail -20 "$OUT/train_sinks.log"
  for v in none zero learnable; do
    (cd /tmp/gpu_sinks && tar cf - --exclude=checkpoints $v | split -b 15M - "$OUT/run_$v.tar.")
  done
  ls -la "$OUT"
  ;;
serve)
  for spec in "8 1024 1,8" "32 1024 8,32" "128 256 32,128"; do
    set -- $spec
    step "serving engine, llama2-7b shapes, $1 rows of 4+$(( $2 - 4 )), streams $3"
    timeout $(( $(left) / 2 )) $PY benchmarks/serve.py --model random:llama2-7b --slots $1 \
      --cache $2 --streams $3 --tokens 32 --long 2048 --turns 0 >> "$OUT/serve.log" 2>&1
    tail -6 "$OUT/serve.log"
  done
  ;;
*) echo "unknown stage $STAGE (suite, kernels, decode, decode2, serve, bench, train or sinks)"; exit 2;;
esac
step done
