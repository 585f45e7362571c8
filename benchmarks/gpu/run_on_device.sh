#!/usr/bin/env bash
# The GPU half in one go (docs/benchmarks.md, "How to run it"):
#   1. mkv_gpu_tests (every launcher on the GPU vs its host twin, graph capture),
#   1b. the engine loop's host cost with GPU tensors next to the CPU twin (mkv_host_bench's
#      BM_RequestLifecycle / BM_Engine*DecodeStep rows, ratios by engine_loop_ratios.py),
#   1c. mkv_launch_probe (the host cost of a kernel launch, a copy, a stream write, a graph),
#   2. mkv_gpu_bench (cases G1-G5 and G7, CSV),
#   3. torch_baselines.py (same shapes in PyTorch, and the G6 comparison with 2.),
#   4. compute-sanitizer memcheck and racecheck over a short selection of mkv_gpu_tests (memcheck
#      also over the reference engine's kernels, the engine-step device writes and the host tier),
#   5. the other test suites of the build folder (CPU suites and their GPU instantiations),
#      mkv_runtime_tests first, while time is left,
#   6. mkv-replay on GPU and on CPU tensors at a model-sized geometry (32 layers x 8 KV heads x
#      head dim 128, page 128: 16 MiB per page), reuse, hybrid reuse (+ 9 recurrent layers) and
#      swa modes, on the embedded workload (reuse and swa also with the device writes at the
#      engine step, with an EAGLE draft, and Hybrid-MTP: the hybrid
#      model with an MTP draft) and the first requests of
#      the bundled Mooncake sample: the figures of both devices must be
#      identical; wall times, requests/s and library host / GPU ns per step are in replay_*.json,
# with every log under $OUT (default ./out), and a short summary table printed last.
##
# Usage:  bash benchmarks/gpu/run_on_device.sh [BUILD_DIR]
#   BUILD_DIR holds tests/<layer>/mkv_*_tests and benchmarks/gpu/mkv_gpu_bench: the build tree of
#   `cmake --preset cuda-release && cmake --build build/cuda-release`, or its small copy
#   build/cuda-release/device (the default when present; the only folder the GPU machine needs).
# The suites find their input files in $BUILD/test_inputs (exported as MKV_TEST_INPUTS).
# MKV_REPLAY_LIMIT (default 12) sets the Mooncake requests of step 6.
# Exit status: 0 when no step failed (a step without GPU, torch or sanitizer is SKIP), 1 else.
set -u

DEFAULT_BUILD=build/cuda-release
[[ -d $DEFAULT_BUILD/device ]] && DEFAULT_BUILD=$DEFAULT_BUILD/device
BUILD=${1:-$DEFAULT_BUILD}
OUT=${OUT:-./out}
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Whole-script budget in seconds: the device tool stops a command after 600 s.
BUDGET=${MKV_DEVICE_BUDGET_S:-540}
SANITIZER_FILTER=${MKV_SANITIZER_FILTER:-'Geometries/CopyPagesGpuTest.*/0:Geometries/CopyPagesGpuTest.*/5:Geometries/CopyPagesGpuTest.*/6:Mappings/CompactBatchGpuTest.*/2:Mappings/CompactBatchGpuTest.*/5:Mappings/CompactBatchMappingTest.*/10:CompactBatchInPlaceTest.*:Widths/*:RowLaunchersGpuTest.*:ZeroRowsGpuTest.*:Int32PatchGpuTest.*:GraphCaptureGpuTest.*:CopyPagesKernelTest.*:PatchRingTest.FlushesLandInOrder*:PatchRingTest.ACaptured*'}
RACECHECK_FILTER=${MKV_RACECHECK_FILTER:-'Mappings/CompactBatchGpuTest.*/2:Mappings/CompactBatchGpuTest.*/7:Mappings/CompactBatchMappingTest.*/10:GraphCaptureGpuTest.CompactBatchReplaysOnFreshData:PatchRingTest.FlushesLandInOrder*'}

mkdir -p "$OUT"
if [[ -d $BUILD/test_inputs ]]; then
  MKV_TEST_INPUTS=$(cd "$BUILD/test_inputs" && pwd)
  export MKV_TEST_INPUTS
fi
START=$(date +%s)
SUMMARY=()
FAILED=0

elapsed() { echo $(( $(date +%s) - START )); }

# record STEP STATUS SECONDS DETAIL
record() {
  SUMMARY+=("$(printf '%-28s %-5s %6s  %s' "$1" "$2" "$3" "$4")")
  [[ $2 == FAIL ]] && FAILED=1
  echo "== $1: $2 ($3 s) $4"
}

# run_step NAME LOG TIMEOUT CMD...: runs CMD with its output in LOG, for at most TIMEOUT s and
# never beyond the script's budget; sets RC (124: stopped) and SECONDS_TAKEN.
run_step() {
  local name=$1 log=$2 limit=$3
  shift 3
  local left=$(( BUDGET - $(elapsed) ))
  (( limit > left )) && limit=$left
  echo "== $name: $*" | tee "$log"
  if (( limit < 5 )); then
    echo "(not run: time budget used up)" >>"$log"
    RC=124 SECONDS_TAKEN=0
    return
  fi
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  RC=$?
  SECONDS_TAKEN=$(( $(date +%s) - t0 ))
  [[ $RC == 124 || $RC == 137 ]] && echo "(stopped after $limit s)" >>"$log"
}

gtest_detail() {  # summary of a gtest log; "on GPU": passed instances named .../gpu, .../Gpu or ..._gpu
  local log=$1 passed skipped failed gpu
  passed=$(grep -oP '^\[  PASSED  \] \K[0-9]+' "$log" | tail -1)
  skipped=$(grep -oP '^\[  SKIPPED \] \K[0-9]+(?= test)' "$log" | tail -1)
  failed=$(grep -oP '^\[  FAILED  \] \K[0-9]+(?= test)' "$log" | tail -1)
  gpu=$(grep -ciE '^\[       OK \] .*[/_]gpu \(' "$log")
  echo "${passed:-0} passed (${gpu:-0} on GPU), ${skipped:-0} skipped, ${failed:-0} failed"
}

gtest_status() {  # STATUS of a gtest run: SKIP when every test skipped (no device)
  local rc=$1 log=$2 passed skipped
  passed=$(grep -oP '^\[  PASSED  \] \K[0-9]+' "$log" | tail -1)
  skipped=$(grep -oP '^\[  SKIPPED \] \K[0-9]+(?= test)' "$log" | tail -1)
  if [[ $rc != 0 ]]; then echo FAIL
  elif [[ ${passed:-0} == 0 && ${skipped:-0} != 0 ]]; then echo SKIP
  else echo PASS; fi
}

{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(uname -a)"
  echo "build: $BUILD"
  echo "bundle commit: $(cat "$BUILD/COMMIT" 2>/dev/null || echo unknown)"
  (cd "$SCRIPT_DIR" && git describe --always --dirty 2>/dev/null) | sed 's/^/scripts commit: /'
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
} >"$OUT/environment.txt" 2>&1
command -v nvidia-smi >/dev/null && nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1

GPU_TESTS=$BUILD/tests/gpu/mkv_gpu_tests
BENCH=$BUILD/benchmarks/gpu/mkv_gpu_bench
HOST_BENCH=$BUILD/benchmarks/host/mkv_host_bench
# Shared libraries the bundle carries (libzmq's chain, Google Benchmark, ...): bundle_shared_libraries.sh.
[[ -d $BUILD/lib ]] && export LD_LIBRARY_PATH=$BUILD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# 0. The no-wait suite in a process of its own with lazy kernel loading (the CUDA default), so no
#    earlier test has loaded the library's kernels: what KVCacheRuntime::create must do itself.
if [[ -x $GPU_TESTS ]]; then
  run_step "no-wait suite" "$OUT/no_wait.log" 60 env CUDA_MODULE_LOADING=LAZY "$GPU_TESTS" \
    --gtest_filter='EngineLoopNoWait*'
  record "engine loop no-wait" "$(gtest_status $RC "$OUT/no_wait.log")" "$SECONDS_TAKEN" \
    "$(gtest_detail "$OUT/no_wait.log")"
fi

# 1. GPU test binary.
if [[ -x $GPU_TESTS ]]; then
  run_step "gpu tests" "$OUT/gpu_tests.log" 180 "$GPU_TESTS" --gtest_output="xml:$OUT/gpu_tests.xml"
  record "mkv_gpu_tests" "$(gtest_status $RC "$OUT/gpu_tests.log")" "$SECONDS_TAKEN" \
    "$(gtest_detail "$OUT/gpu_tests.log")"
else
  record "mkv_gpu_tests" FAIL 0 "$GPU_TESTS missing (build with the cuda-release preset)"
fi

# 1b. Engine loop: host cost per request and per decode step, GPU tensors vs the CPU twin.
if [[ -x $HOST_BENCH ]]; then
  run_step "engine loop bench" "$OUT/engine_loop.log" 240 "$HOST_BENCH" \
    --benchmark_filter='BM_RequestLifecycle|BM_Engine|BM_InlinePatch' --benchmark_repetitions=5 \
    --benchmark_min_time=0.2 \
    --benchmark_report_aggregates_only=true --benchmark_out="$OUT/engine_loop.json" \
    --benchmark_out_format=json
  if [[ $RC == 0 ]]; then
    python3 "$SCRIPT_DIR/engine_loop_ratios.py" "$OUT/engine_loop.json" >"$OUT/engine_loop_ratios.txt" 2>&1
    case $? in
      0 | 3) status=PASS ;;  # 3: a row misses the 1.5x target; the detail says how many
      77) status=SKIP ;;
      *) status=FAIL ;;
    esac
    record "engine loop (GPU/CPU)" "$status" "$SECONDS_TAKEN" "$(tail -1 "$OUT/engine_loop_ratios.txt")"
  else
    record "engine loop (GPU/CPU)" FAIL "$SECONDS_TAKEN" "mkv_host_bench rc $RC"
  fi
else
  record "engine loop (GPU/CPU)" FAIL 0 "$HOST_BENCH missing"
fi

# 1c. What one write of the stream costs the host, by mechanism (the floor of 1b's GPU rows).
LAUNCH_PROBE=$BUILD/benchmarks/gpu/mkv_launch_probe
if [[ -x $LAUNCH_PROBE ]]; then
  run_step "launch probe" "$OUT/launch_probe.log" 60 "$LAUNCH_PROBE"
  record "launch probe" "$([[ $RC == 0 ]] && echo PASS || echo FAIL)" "$SECONDS_TAKEN" \
    "$(grep -m1 'no parameters' "$OUT/launch_probe.log" | tr -s ' ')"
else
  record "launch probe" FAIL 0 "$LAUNCH_PROBE missing"
fi

# 2. Benchmark (exit 77: no device).
if [[ -x $BENCH ]]; then
  run_step "gpu bench" "$OUT/gpu_bench.log" 300 "$BENCH" --csv "$OUT/gpu_bench.csv"
  case $RC in
    0) status=PASS ;;
    77) status=SKIP ;;
    *) status=FAIL ;;
  esac
  BENCH_DETAIL=$(tail -1 "$OUT/gpu_bench.log")  # the table's tally, or why nothing ran
  record "mkv_gpu_bench" "$status" "$SECONDS_TAKEN" "rc $RC: $BENCH_DETAIL"
else
  record "mkv_gpu_bench" FAIL 0 "$BENCH missing"
fi

# 3. Torch baselines (exit 77: no torch or no device).
TORCH_ARGS=(--csv "$OUT/torch_baselines.csv")
[[ -f $OUT/gpu_bench.csv ]] && TORCH_ARGS+=(--mkv-csv "$OUT/gpu_bench.csv")
if command -v python3 >/dev/null; then
  run_step "torch baselines" "$OUT/torch_baselines.log" 240 python3 "$SCRIPT_DIR/torch_baselines.py" "${TORCH_ARGS[@]}"
  case $RC in
    0) status=PASS ;;
    77) status=SKIP ;;
    *) status=FAIL ;;
  esac
  g6=$(grep -cE ' PASS$' "$OUT/torch_baselines.log" 2>/dev/null)
  g6miss=$(grep -cE ' MISS$' "$OUT/torch_baselines.log" 2>/dev/null)
  record "torch_baselines.py" "$status" "$SECONDS_TAKEN" "rc $RC; G6 gates: ${g6:-0} PASS, ${g6miss:-0} MISS"
else
  record "torch_baselines.py" SKIP 0 "no python3"
fi

# 4. compute-sanitizer over a short selection of the GPU tests.
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
for tool in memcheck racecheck; do
  filter=$SANITIZER_FILTER
  [[ $tool == racecheck ]] && filter=$RACECHECK_FILTER
  if [[ -z $SANITIZER || ! -x $GPU_TESTS ]]; then
    record "compute-sanitizer $tool" SKIP 0 "compute-sanitizer not found"
    continue
  fi
  if [[ $(gtest_status 0 "$OUT/gpu_tests.log") == SKIP ]]; then
    record "compute-sanitizer $tool" SKIP 0 "no device"
    continue
  fi
  run_step "compute-sanitizer $tool" "$OUT/sanitizer_$tool.log" 150 \
    "$SANITIZER" --tool "$tool" --error-exitcode 3 --print-limit 20 "$GPU_TESTS" --gtest_filter="$filter"
  summary_line=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)
  [[ $RC == 0 ]] && status=PASS || status=FAIL
  record "compute-sanitizer $tool" "$status" "$SECONDS_TAKEN" "rc $RC; $(gtest_detail "$OUT/sanitizer_$tool.log"); ${summary_line:-no summary}"
done
# memcheck_suite LABEL LOG BINARY FILTER [LIMIT_S]: compute-sanitizer memcheck over the tests of
# BINARY that FILTER selects, with its output in $OUT/LOG.log, recorded as LABEL, stopped after
# LIMIT_S seconds (default 120); nothing without the sanitizer, the binary or a device.
memcheck_suite() {
  local label=$1 log=$OUT/$2.log binary=$3 filter=$4 limit=${5:-120} summary_line status
  [[ -n $SANITIZER && -x $binary && $(gtest_status 0 "$OUT/gpu_tests.log") != SKIP ]] || return 0
  run_step "$label" "$log" "$limit" "$SANITIZER" --tool memcheck --error-exitcode 3 --print-limit 20 \
    "$binary" --gtest_filter="$filter"
  summary_line=$(grep -E 'ERROR SUMMARY' "$log" | tail -1)
  [[ $RC == 0 ]] && status=PASS || status=FAIL
  record "$label" "$status" "$SECONDS_TAKEN" "rc $RC; $(gtest_detail "$log"); ${summary_line:-no summary}"
}
RUNTIME_TESTS=$BUILD/tests/runtime/mkv_runtime_tests
# ... over the reference engine's step kernels (tests/testing: CPU vs GPU parity runs),
memcheck_suite "compute-sanitizer engine" sanitizer_memcheck_engine \
  "$BUILD/tests/testing/mkv_testing_tests" 'Shapes/ReferenceEngineParityTest.*'
# ... over the runtime's writes at the engine step and the flushes that fail
#     (tests/runtime/device_write_timing_test.cpp, device_write_fault_test.cpp),
memcheck_suite "compute-sanitizer engine step" sanitizer_memcheck_engine_step "$RUNTIME_TESTS" \
  '*DeviceWriteTimingTest*_gpu:*EngineStepWorkloadTest*_gpu:*DeviceWriteFaultTest*_gpu:*RetractionFaultTest*_gpu' \
  180
# ... over the host tier: its copy kernels read and write pinned host memory through mapped
#     addresses (the coordinator's lifecycles with offload and onboarding, and the tier itself),
for host_suite in context_cache resources; do
  memcheck_suite "sanitizer host tier $host_suite" "sanitizer_memcheck_host_tier_$host_suite" \
    "$BUILD/tests/$host_suite/mkv_${host_suite}_tests" '*HostTier*gpu:*HostKvTier*gpu'
done
# ... and over sliding-window reuse on GPU tensors (both halves' tables, the reused windows, the
#     window cache's pages under the oracle's step kernels).
memcheck_suite "sanitizer sliding reuse" sanitizer_memcheck_sliding_reuse "$RUNTIME_TESTS" \
  '*SlidingReuseTest*gpu'
# ... over reuse points (the engine's writes into the snapshot slabs, their restores) and chunked
#     prefill of joiners (each chunk's publication), on GPU tensors.
memcheck_suite "sanitizer reuse points, chunks" sanitizer_memcheck_points_chunks \
  "$BUILD/tests/context_cache/mkv_context_cache_tests" '*HybridReusePointTest*gpu:*Chunk*gpu'
# ... and over the kernel-ready views of a GPU table (one launch per step, every capacity).
memcheck_suite "sanitizer attention views" sanitizer_memcheck_attention_views "$RUNTIME_TESTS" \
  '*AttentionViewsTest*/gpu'

# 5. The other test suites of the build folder, while the budget lasts: the runtime's end-to-end
#    scenarios (facade, faults, reference engine, on CPU and GPU tensors) first.
SUITES=()
[[ -x $BUILD/tests/runtime/mkv_runtime_tests ]] || record "mkv_runtime_tests" FAIL 0 \
  "$BUILD/tests/runtime/mkv_runtime_tests missing"
for suite in "$BUILD"/tests/runtime/mkv_runtime_tests "$BUILD"/tests/*/mkv_*_tests; do
  [[ " ${SUITES[*]} " == *" $suite "* ]] || SUITES+=("$suite")
done
for suite in "${SUITES[@]}"; do
  [[ -x $suite && $suite != "$GPU_TESTS" ]] || continue
  name=$(basename "$suite")
  left=$(( BUDGET - $(elapsed) ))
  if (( left < 30 )); then
    record "$name" SKIP 0 "time budget used up"
    continue
  fi
  filter=()
  if [[ $name == mkv_remote_tests ]] && ! command -v redis-server >/dev/null; then
    filter=(--gtest_filter='-*Redis*')  # no Redis server here: the directory store's tests only
  fi
  run_step "$name" "$OUT/$name.log" "$left" "$suite" --gtest_output="xml:$OUT/$name.xml" \
    "${filter[@]}"
  record "$name" "$(gtest_status $RC "$OUT/$name.log")" "$SECONDS_TAKEN" "$(gtest_detail "$OUT/$name.log")"
done

# 6. mkv-replay, GPU vs CPU tensors at a model-sized geometry. Pools: 256 pages (4 GiB) for the
#    embedded workload (it peaks at 146), 1024 pages (16 GiB) for the Mooncake requests; swa
#    sizes its own pool (window pages per sequence). Both fit the host's and the GPU's memory.
REPLAY=$BUILD/benchmarks/replay/mkv-replay
TRACE=${MKV_TEST_INPUTS:-$BUILD/test_inputs}/tests/data/mooncake_first500.jsonl
LIMIT=${MKV_REPLAY_LIMIT:-12}
GEOMETRY=(--layers 32 --kv-heads 8 --head-dim 128 --page-size 128 --verify sample --quiet)
CASE_GEOMETRY=()  # serving_case's arguments in GEOMETRY's place
replay_case() {  # NAME ARGS...: one run per device (GEOMETRY appended), then the figures compared
  local name=$1
  shift
  local left=$(( BUDGET - $(elapsed) ))
  if (( left < 60 )); then
    record "mkv-replay $name" SKIP 0 "time budget used up"
    return
  fi
  local device status=PASS detail=""
  local -a geometry=("${GEOMETRY[@]}")
  if ((${#CASE_GEOMETRY[@]})); then
    geometry=("${CASE_GEOMETRY[@]}")
  fi
  for device in cuda cpu; do
    run_step "mkv-replay $name $device" "$OUT/replay_${name}_$device.log" 240 \
      "$REPLAY" "$@" "${geometry[@]}" --device "$device" \
      --json "$OUT/replay_${name}_$device.json"
    if [[ $RC != 0 ]]; then
      status=FAIL
      detail+="$device rc $RC; "
      continue
    fi
    detail+="$device $(grep -oP '"wall_s": \K[0-9.]+' "$OUT/replay_${name}_$device.json") s"
    detail+=" (GPU ns/step $(grep -oP '"gpu_ns_per_step_mean": \K[0-9]+' "$OUT/replay_${name}_$device.json")); "
  done
  if [[ $status == PASS ]]; then
    # Everything but the device and the timings must agree.
    local timing='"(device|wall_s|requests_per_s|host_ns_per_step_[a-z0-9]+|gpu_[a-z_0-9]+|coordinator_timings)":'
    if ! diff <(grep -vE "$timing" "$OUT/replay_${name}_cuda.json") \
              <(grep -vE "$timing" "$OUT/replay_${name}_cpu.json") >"$OUT/replay_${name}_diff.txt"; then
      status=FAIL
      detail+="figures differ (replay_${name}_diff.txt)"
    fi
  fi
  record "mkv-replay $name" "$status" "" "$detail"
}
# The serving engine (#37) on the first 500 Mooncake requests at mkv-replay's default geometry
# (a model's would take the CPU-tensor run hours): batch 16 under a 160k-token pool that evicts
# and preempts; the caller adds the token budget and the preemption kind.
serving_case() {  # NAME ARGS...
  CASE_GEOMETRY=(--trace "$TRACE" --max-batch 16 --pool-tokens 160000 --verify sample --quiet)
  replay_case "$@"
  CASE_GEOMETRY=()
}
if [[ ! -x $REPLAY ]]; then
  record "mkv-replay" FAIL 0 "$REPLAY missing (cuda-release builds it)"
elif [[ $(gtest_status 0 "$OUT/gpu_tests.log") == SKIP ]]; then
  record "mkv-replay" SKIP 0 "no device"
else
  # The serving cases first: seconds each, at the default geometry.
  if [[ -f $TRACE ]]; then
    serving_case mooncake_serving_recompute --max-batched-tokens 2048 --preemption recompute
    # Swap moves decoding rows' blocks to the host tier (with a token budget the rows preempted
    # on this sample are still prefilling: nothing to swap).
    serving_case mooncake_serving_swap --preemption swap --host-pool-tokens 160000
    # Hybrid joiners (3 attention + 9 recurrent layers), unbounded pool: restores at admission,
    # recurrent state carried across chunks, chunk ends kept as reuse points.
    CASE_GEOMETRY=(--trace "$TRACE" --max-batch 16 --verify sample --quiet)
    replay_case mooncake_serving_hybrid --max-batched-tokens 2048 --layers 3 --recurrent-layers 9 \
      --checkpoint-interval 512 --no-attention-only
    # Bounded-SWA joiners: chunks whose window rotates within each joiner's 2M + 1 pages.
    replay_case mooncake_serving_swa --mode swa --window 4096 --full-layers 1 \
      --max-batched-tokens 2048
    # Reuse points every page under a snapshot budget that keeps one in 32 of them: the ranked
    # speculations (branch-first, the default) thin every prompt's points.
    replay_case mooncake_serving_hybrid_budget --max-batched-tokens 2048 --layers 3 \
      --recurrent-layers 9 --checkpoint-interval 128 --snapshot-slots 2000 --no-attention-only
    CASE_GEOMETRY=(--trace "$TRACE" --verify sample --quiet)
    # Sliding-window reuse with the windows before reuse points ranked, in a budget that evicts.
    replay_case mooncake_sliding_points --layers 5 --window 1024 --full-layers 1 \
      --kv-budget-bytes 72000000 --checkpoint-interval 2048
    CASE_GEOMETRY=()
  fi
  replay_case embedded_reuse --pool-tokens 32768
  # Hybrid checkpoints: 96 snapshot slots (1.5 GiB of partial pages) keep every restore.
  replay_case embedded_hybrid --pool-tokens 32768 --recurrent-layers 9 --snapshot-slots 96 \
    --no-attention-only
  replay_case embedded_swa --mode swa --window 1024 --full-layers 1 --max-batch 4
  # The same two with the library's device writes at the engine step (one flush per step).
  replay_case embedded_reuse_engine_step --pool-tokens 32768 --device-writes engine-step
  replay_case embedded_swa_engine_step --mode swa --window 1024 --full-layers 1 --max-batch 4 \
    --device-writes engine-step
  # The host tier: a 40-page GPU pool (640 MiB) that evicts, and 300 pages (4.7 GiB) of pinned
  # host memory that keep what it evicts; the lookups onboard them back.
  replay_case embedded_host_tier --pool-pages 40 --host-pool-tokens 38400 --eviction lru

  # Sliding-window reuse: the 32 layers sliding (W = 512) beside 4 full ones, 6 GiB of KV split
  # 70 / 30 between the sliding pool (16 MiB pages) and the full pool (2 MiB pages); joins in
  # flight at batch 4.
  replay_case embedded_sliding_reuse --window 512 --full-layers 4 --max-batch 4 --kv-budget-bytes 6442450944
  # An EAGLE deployment: paired base + draft reuse, the draft's KV checked by its own oracle.
  replay_case embedded_eagle --pool-tokens 32768 --speculative eagle --draft-layers 1
  # Hybrid-MTP: prompt endpoints with their boundary hidden rows, checked by the hidden-row oracle;
  # served as an engine would (batch 16, joiners, founders and joiners in chunks of a budget).
  replay_case embedded_hybrid_mtp --pool-tokens 32768 --recurrent-layers 9 --snapshot-slots 96 \
    --speculative mtp --draft-layers 1 --no-attention-only --max-batch 16 --max-batched-tokens 512
  # Reuse points every 256 tokens (the reference engine's step kernels write the snapshot slots);
  # chunked prefill of joiners under a token budget of 256 a step.
  replay_case embedded_hybrid_points --pool-tokens 32768 --recurrent-layers 9 --snapshot-slots 96 \
    --checkpoint-interval 256 --no-attention-only
  replay_case embedded_chunked --pool-tokens 32768 --max-batch 4 --max-batched-tokens 256
  if [[ -f $TRACE ]]; then
    replay_case mooncake_reuse --trace "$TRACE" --limit "$LIMIT" --pool-tokens 131072
    replay_case mooncake_swa --trace "$TRACE" --limit "$LIMIT" --mode swa --window 4096 --full-layers 1 --max-batch 4
    replay_case mooncake_sliding_reuse --trace "$TRACE" --limit "$LIMIT" --window 4096 \
      --full-layers 4 --kv-budget-bytes 17179869184
    replay_case mooncake_hybrid_points --trace "$TRACE" --limit "$LIMIT" --pool-tokens 131072 \
      --recurrent-layers 9 --snapshot-slots 96 --checkpoint-interval 2048 --no-attention-only
    replay_case mooncake_chunked --trace "$TRACE" --limit "$LIMIT" --pool-tokens 131072 \
      --max-batch 8 --max-batched-tokens 2048
  else
    record "mkv-replay mooncake" FAIL 0 "$TRACE missing (the bundle's test_inputs)"
  fi
fi

{
  if [[ -f $OUT/gpu_bench.csv ]]; then
    echo
    echo "benchmark rows that missed their target (full table: $OUT/gpu_bench.log):"
    grep -F ',MISS,' "$OUT/gpu_bench.csv" | cut -d, -f1,2,4,6,7 | sed 's/^/  /' || true
  fi
  echo
  printf '%-28s %-5s %6s  %s\n' "step" "state" "s" "detail"
  printf '%s\n' "${SUMMARY[@]}"
  echo "logs: $OUT (total $(elapsed) s)"
} | tee "$OUT/summary.txt"
exit $FAILED
