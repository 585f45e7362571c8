#!/usr/bin/env bash
# The remote tier on the GPU machine (docs/benchmarks.md, "Remote tier"): its coordinator tests on
# GPU tensors, under compute-sanitizer memcheck, and two mkv-replay processes sharing one
# directory store (the GPU machine runs no Redis server) on GPU and on CPU tensors: the second
# process reuses what the first computed, and a decode process onboards what a prefill process
# handed over; the oracle reads every onboarded position (0 mismatches in every process), and the
# handoff's figures must agree between the devices (the other pairs depend on the tier's
# asynchronous saves: see the comparison below).
#
# Usage: OUT=DIR remote_tier_on_device.sh BUILD_DIR   (BUILD_DIR: a cuda-release build or bundle;
# the bundle's libraries on LD_LIBRARY_PATH, BUILD_DIR/lib)
set -uo pipefail
BUILD=$1
OUT=${OUT:-/tmp/mkv_remote_tier}
mkdir -p "$OUT"
FAILED=0
export LD_LIBRARY_PATH=$BUILD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
step() {  # NAME LOG COMMAND...: runs it, prints one line
  local name=$1 log=$2
  shift 2
  local start=$SECONDS
  "$@" >"$log" 2>&1
  local rc=$?
  printf '%-40s rc %-3s %4s s\n' "$name" "$rc" "$((SECONDS - start))"
  ((rc == 0)) || FAILED=1
}
# A redis-server carried with the bundle (BUILD/redis: Debian's binary and the libraries it loads)
# when the machine has none.
if ! command -v redis-server >/dev/null && [[ -x $BUILD/redis/bin/redis-server ]]; then
  export PATH=$BUILD/redis/bin:$PATH
  export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$BUILD/redis/lib
fi
STORE_FILTER=()
command -v redis-server >/dev/null || STORE_FILTER=(--gtest_filter='-*Redis*')
CC_TESTS=$BUILD/tests/context_cache/mkv_context_cache_tests
step "remote tier tests (gpu)" "$OUT/remote_tests.log" "$CC_TESTS" \
  --gtest_filter='*RemoteTier*gpu:*RemoteBlockCodec*:*RemoteDeployment*'
step "store tests (redis: $(command -v redis-server >/dev/null && echo yes || echo no))" \
  "$OUT/remote_store_tests.log" "$BUILD/tests/remote/mkv_remote_tests" "${STORE_FILTER[@]}"
if SANITIZER=$(command -v compute-sanitizer); then
  step "memcheck remote tier" "$OUT/remote_memcheck.log" "$SANITIZER" --tool memcheck \
    --error-exitcode 3 "$CC_TESTS" --gtest_filter='*RemoteTier*gpu'
fi

REPLAY=$BUILD/benchmarks/replay/mkv-replay
TRACE=${MKV_TEST_INPUTS:-$BUILD/test_inputs}/tests/data/mooncake_first500.jsonl
# mkv-replay's default geometry (4 KiB pages): a model's (16 MiB pages) would write hundreds of
# GiB of blocks to the store for these 500 requests.
COMMON=(--trace "$TRACE" --verify sample --quiet --pool-tokens 100000 --host-pool-tokens 50000)
STORE=$(mktemp -d)
PORT=6391
for device in cuda cpu; do
  find "${STORE:?}" -mindepth 1 -delete
  for run in first second; do
    step "mkv-replay $run ($device)" "$OUT/replay_${run}_$device.log" "$REPLAY" "${COMMON[@]}" \
      --device "$device" --remote-tier "file://$STORE" --json "$OUT/replay_${run}_$device.json"
  done
  if command -v redis-server >/dev/null; then  # the same pair on a Redis server of its own
    PORT=$((PORT + 1))
    redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
      --logfile "$OUT/redis_$PORT.log" --pidfile "$OUT/redis_$PORT.pid" >/dev/null
    sleep 1
    for run in redis_first redis_second; do
      step "mkv-replay $run ($device)" "$OUT/replay_${run}_$device.log" "$REPLAY" \
        "${COMMON[@]}" --device "$device" --remote-tier "redis://127.0.0.1:$PORT" \
        --json "$OUT/replay_${run}_$device.json"
    done
    kill "$(cat "$OUT/redis_$PORT.pid")"
  fi
  find "${STORE:?}" -mindepth 1 -delete
  for role in prefill decode; do
    step "mkv-replay $role ($device)" "$OUT/replay_${role}_$device.log" "$REPLAY" "${COMMON[@]}" \
      --device "$device" --remote-tier "file://$STORE" --role "$role" \
      --json "$OUT/replay_${role}_$device.json"
  done
done
rm -rf "$STORE"
timing='"(device|wall_s|requests_per_s|host_ns_per_step_[a-z0-9]+|gpu_[a-z_0-9]+|coordinator_timings|load_wait_ms|handoff_wait_ms|store)":'
# Only the handoff is deterministic: a prefill process waits for its saves, so the decode process
# finds every block. A first or second process finds what the tier's worker saved before each
# lookup (asynchronous saves, at most maxPendingSaves in flight): its figures follow the worker's
# timing, differ from run to run on one device, and are printed side by side, not compared.
for run in prefill decode; do
  [[ -f $OUT/replay_${run}_cuda.json ]] || continue
  if diff <(grep -vE "$timing" "$OUT/replay_${run}_cuda.json") \
          <(grep -vE "$timing" "$OUT/replay_${run}_cpu.json") >"$OUT/replay_${run}_diff.txt"; then
    echo "mkv-replay $run: GPU and CPU figures agree"
  else
    echo "mkv-replay $run: figures differ (replay_${run}_diff.txt)"
    FAILED=1
  fi
done
for json in "$OUT"/replay_*_cpu.json; do
  python3 - "$json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{sys.argv[1].rsplit('/', 1)[-1]}: hit rate {d['hit_rate']:.4f}, reused {d['reused_tokens']}, "
      f"oracle {d['oracle_checks']} checked {d['oracle_mismatches']} mismatches")
sys.exit(1 if d["oracle_mismatches"] else 0)
PY
  (($? == 0)) || FAILED=1
done
for json in "$OUT"/replay_*_cuda.json; do
  python3 - "$json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
t = d.get("remote_tier", {})
print(f"{sys.argv[1].rsplit('/', 1)[-1]}: hit rate {d['hit_rate']:.4f}, reused {d['reused_tokens']}, "
      f"loaded {t.get('loaded_blocks')} blocks / {t.get('loaded_bytes')} B in {t.get('load_wait_ms')} ms, "
      f"saved {t.get('saved_blocks')} / {t.get('saved_bytes')} B, handoff wait {t.get('handoff_wait_ms')} ms, "
      f"oracle {d['oracle_checks']} checked {d['oracle_mismatches']} mismatches, wall {d['wall_s']} s")
sys.exit(1 if d["oracle_mismatches"] else 0)
PY
  (($? == 0)) || FAILED=1
done
exit $FAILED
