#!/usr/bin/env bash
# One lent-GPU session's work in one call (the device tool's METHOD.md: batch the runs, logs under
# $OUT, a short table last). Stages, run in the order given:
#   tests    the test suite at real sizes (tests marked gpu included); $TESTS narrows it
#   tune     the shipped tables: every kernel of every spec in specs/ (--write-table attngen/tuned)
#   tunedecode, tunebackward   the KV-cache kernels (a wide search) / the backward kernels and train_d128's forward
#   compare  benchmarks/tuned_vs_default.py: tuned vs default vs FlexAttention, d=128 N=4096
#   compile  benchmarks/compile_time.py: first call, cached second process, one binary for all lengths
#   decode   attngen bench --suite decode (contiguous, paged 16 and 64; SDPA's flash, cuDNN and
#            efficient backends, FlexAttention, naive)
#   prefill  attngen bench --suite prefill, both directions, d=64 and 128, N 512..16384
#   variants attngen bench --suite variants: masks and score modifiers against FlexAttention (and cuDNN's
#            causal), B=1 H=16 N=16384 d=128, both directions; its --check first (each row against float64)
#   varlen   attngen bench --suite varlen: packed documents against FlexAttention's document mask, varlen_attn
#            and cuDNN's dense causal; one long prompt beside short ones; a mixed prefill+decode step in one
#            paged call; SDPA through the flash-attention slot against attngen.attention; its --check first
#   shapes   attngen bench --suite shapes: issue 51's head shapes (d=96, 256, GQA 28/4, d=64 at odd lengths,
#            DeepSeek's 192/128) against cuDNN, FlexAttention and FA2, both directions; its --check first
#   fp8      attngen bench --suite fp8: the FP8 forward against attngen's bf16 forward, cuDNN (bf16) and torch's
#            FP8 SDPA (FA3, where installed), d=128 N 4096..16384, with each one's error against float64; its
#            --check first
#            (the bench stages stop after $BENCH_TIMEOUT s, default 400)
#   fp8gluon the FP8 Gluon forward, switched on (policy/hopper.py FP8_GLUON) in its own processes and kernel caches:
#            tests/test_gluon_fp8.py (its gpu test against float64, d=64 and 128), then attngen bench --suite fp8
#            (rows attngen_fp8 and attngen_fp8_vt now the Gluon kernel's, beside attngen_bf16 and cuDNN)
#   cp       benchmarks/context_parallel.py under torchrun: one GPU, then every GPU of the machine ($CP_LENGTHS,
#            default 131072 262144; $CP_PROVIDERS, default all; $CP_ROUNDS, the providers measured in turn that
#            many times, default 1; the speed-ups need the one-GPU rows; $CP_GPUS, the GPU counts to run, default
#            1 and every GPU), and
#            tests/test_distributed.py's NCCL tests first (CP_TESTS=0: not)
# usage (device tool, carrying .whl from ../shared/gpu/wheels.sh):
#   <the wheel line>; bash benchmarks/gpu_session.sh tests compare
set -uo pipefail
OUT=${OUT:-/tmp/attngen-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SLUG=$(python3 -c "import torch,re;print(re.sub(r'[^a-z0-9]+','_',torch.cuda.get_device_name().lower()).strip('_'))")
START=$(date +%s)
stamp() { echo "[$(( $(date +%s) - START )) s] $*" | tee -a "$OUT/summary.txt"; }
TUNE="python3 -m attngen tune --max-configs 10 --rep 10 --write-table attngen/tuned"
for stage in "$@"; do
  stamp "start $stage"
  case $stage in
    tests)
      timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider --durations=15 ${TESTS:-} 2>&1 | tee "$OUT/tests.txt" | tail -3 ;;
    tune)
      timeout 560 $TUNE specs/*.attn > "$OUT/tune.txt" 2> "$OUT/tune_progress.txt"
      mkdir -p "$OUT/tuned"; cp attngen/tuned/*.json "$OUT/tuned/" ;;
    tunedecode)
      # decode kernels take microseconds: search BLOCK_N x stages x every split count, not the 10 nearest
      # (72: the paged spec adds the Gluon kernel at each split count on Hopper)
      timeout 420 $TUNE specs/decode_d128.attn specs/decode_paged16_d128.attn --kind decode --max-configs 72 \
        --values block_n=64,128 num_warps=4 num_stages=3,4,5,6 >> "$OUT/tune.txt" 2>> "$OUT/tune_progress.txt"
      timeout 120 $TUNE specs/prefill_paged64_d128.attn --kind decode >> "$OUT/tune.txt" 2>> "$OUT/tune_progress.txt"
      # short caches at batch 16 and 64 (hundreds of short programs: fewer stages mean more of them to
      # an SM): fewer warps and stages than the search above, one split (two lost in a sweep, NOTES v20),
      # replacing its 1k entries for those batches
      timeout 200 $TUNE specs/decode_d128.attn specs/decode_paged16_d128.attn --kind decode --seqlens 1:1024 \
        --batch 16 64 --max-configs 20 --values block_n=32,64 num_warps=1,2,4 num_stages=2,3,4 num_splits=1 \
        >> "$OUT/tune.txt" 2>> "$OUT/tune_progress.txt"
      mkdir -p "$OUT/tuned"; cp attngen/tuned/*.json "$OUT/tuned/"
      grep -v "^ *\(ok\|skipped\|failed\|rejected\)" "$OUT/tune.txt" | cut -c1-230 | tail -40 ;;
    tunebackward)
      timeout 60 $TUNE specs/train_d128.attn --kind forward --seqlens 4096 16384 >> "$OUT/tune.txt" 2>> "$OUT/tune_progress.txt"
      timeout 330 $TUNE --max-configs 8 specs/train_causal_d64.attn specs/train_gqa_d128.attn specs/train_d128.attn \
        --kind backward --seqlens 4096 16384 >> "$OUT/tune.txt" 2>> "$OUT/tune_progress.txt"
      mkdir -p "$OUT/tuned"; cp attngen/tuned/*.json "$OUT/tuned/"
      grep -v "^ *\(ok\|skipped\|failed\|rejected\)" "$OUT/tune.txt" | cut -c1-160 | tail -40 ;;
    compare)
      timeout 120 python3 benchmarks/tuned_vs_default.py -o "$OUT/tuned_vs_default_$SLUG.json" 2>&1 | tail -8 ;;
    compile)
      timeout 150 python3 benchmarks/compile_time.py -o "$OUT/compile_$SLUG.json" 2>&1 | tail -12 ;;
    decode|prefill)
      mkdir -p "$OUT/bench"; cp "benchmarks/results/$SLUG.json" "$OUT/bench/" 2>/dev/null
      timeout ${BENCH_TIMEOUT:-400} python3 -m attngen bench --suite "$stage" -o "$OUT/bench" > "$OUT/bench_$stage.txt" 2>&1
      tail -40 "$OUT/bench_$stage.txt" ;;
    variants|varlen|shapes|fp8)
      mkdir -p "$OUT/bench"; cp "benchmarks/results/${stage}_$SLUG.json" "$OUT/bench/" 2>/dev/null
      timeout 120 python3 -m attngen bench --suite "$stage" --check > "$OUT/bench_${stage}_check.txt" 2>&1
      tail -12 "$OUT/bench_${stage}_check.txt"
      timeout ${BENCH_TIMEOUT:-400} python3 -m attngen bench --suite "$stage" -o "$OUT/bench" > "$OUT/bench_$stage.txt" 2>&1
      tail -40 "$OUT/bench_$stage.txt" ;;
    fp8gluon)
      ATTNGEN_CACHE_DIR=$(mktemp -d) timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -s \
        tests/test_gluon_fp8.py 2>&1 | tee "$OUT/tests_fp8gluon.txt" | tail -12
      mkdir -p "$OUT/bench_fp8gluon"
      ATTNGEN_CACHE_DIR=$(mktemp -d) timeout ${BENCH_TIMEOUT:-400} python3 -c "from attngen.policy import hopper
hopper.FP8_GLUON = True
from attngen.cli import main
raise SystemExit(main(['bench', '--suite', 'fp8', '-o', '$OUT/bench_fp8gluon']))" > "$OUT/bench_fp8gluon.txt" 2>&1
      tail -40 "$OUT/bench_fp8gluon.txt" ;;
    cp)
      GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
      [ "${CP_TESTS:-1}" = 1 ] && timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py -k nccl \
        2>&1 | tail -3
      for n in ${CP_GPUS:-$(printf "1\n%s\n" "$GPUS" | sort -nu)}; do
        timeout ${BENCH_TIMEOUT:-400} torchrun --nproc-per-node $n benchmarks/context_parallel.py \
          --lengths ${CP_LENGTHS:-131072 262144} --rounds ${CP_ROUNDS:-1} ${CP_PROVIDERS:+--providers $CP_PROVIDERS} \
          >> "$OUT/bench_cp.txt" 2>&1
      done
      cp benchmarks/results/context_parallel_*.json "$OUT/" 2>/dev/null
      tail -20 "$OUT/bench_cp.txt" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  stamp "done $stage (exit $?)"
done
