#!/usr/bin/env bash
# The Python module on the GPU machine (docs/python.md, "On the GPU machine"). That machine has
# its own Python (with CUDA torch and transformers), nvcc and pybind11, but not the Debian
# development packages the library's CMake build wants; so the library is built here (the
# cuda-release preset), and there only the bindings' four sources are compiled against it.
#
# Usage:
#   here:  bash benchmarks/gpu/python_on_device.sh --pack [BUILD_DIR]
#          copies into BUILD_DIR/device/pylib what the module needs besides the source tree: the
#          CUDA build's libmanagedkv.a, the fmt and spdlog headers and libfmt (default BUILD_DIR
#          build/cuda-release; then tar BUILD_DIR/device as run_on_device.sh's bundle);
#   there: bash benchmarks/gpu/python_on_device.sh [DEVICE_DIR]
#          compiles _managedkv for that machine's python3 into $OUT/pkg/managedkv, then runs the
#          Python tests (tests/python/test_*.py) and the parity with CUDA tensors against the dense
#          reference and, where transformers is installed, against transformers; logs and JSON
#          under $OUT (default ./out). MODELS (default "llama gemma3 hybrid") picks the parity's
#          models; BUILD_ONLY=1 stops after the build (PYTHONPATH=$OUT/pkg then imports it).
#          Exit status 0 when everything passed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"

if [[ ${1:-} == --pack ]]; then
  build=${2:-build/cuda-release}
  pylib=$build/device/pylib
  rm -rf "$pylib"
  mkdir -p "$pylib/include" "$pylib/lib"
  cp "$build/src/libmanagedkv.a" "$pylib/lib/"
  cp -r /usr/include/fmt /usr/include/spdlog "$pylib/include/"
  cp -L /usr/lib/x86_64-linux-gnu/libfmt.so.9 "$pylib/lib/"
  echo "packed $pylib ($(du -sh "$pylib" | cut -f1))"
  exit 0
fi

device=${1:-build/cuda-release/device}
pylib=$(cd "$device/pylib" && pwd)
OUT=${OUT:-./out}
mkdir -p "$OUT/pkg/managedkv"
OUT=$(cd "$OUT" && pwd)
python=${PYTHON:-python3}
models=${MODELS:-llama gemma3 hybrid}
cuda=${CUDA_HOME:-/usr/local/cuda}
suffix=$($python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
package=$OUT/pkg/managedkv
cp python/managedkv/*.py "$package/"

# The CUDA build's compile definitions (fmt header-only, spdlog on external fmt).
start=$SECONDS
g++ -std=c++20 -O1 -shared -fPIC -fvisibility=hidden \
  -DFMT_HEADER_ONLY=1 -DFMT_SHARED -DMKV_WITH_CUDA=1 -DSPDLOG_FMT_EXTERNAL \
  -Iinclude -Isrc -Ikernels -Ipython/src -isystem "$pylib/include" -isystem "$cuda/include" \
  $($python -m pybind11 --includes) \
  python/src/module.cpp python/src/runtime.cpp python/src/tensor.cpp python/src/types.cpp \
  -o "$package/_managedkv$suffix" \
  "$pylib/lib/libmanagedkv.a" "$pylib/lib/libfmt.so.9" \
  "$cuda/lib64/libcudart_static.a" -ldl -lrt -lpthread -Wl,-rpath,"$pylib/lib" \
  2>&1 | tee "$OUT/build.log"
echo "== built $package/_managedkv$suffix in $((SECONDS - start)) s"
[[ ${BUILD_ONLY:-0} == 1 ]] && exit 0

export PYTHONPATH=$OUT/pkg PYTHONUNBUFFERED=1
failed=0
for test in tests/python/test_*.py; do
  if $python "$test" >"$OUT/$(basename "$test" .py).log" 2>&1; then
    echo "== $test: PASS"
  else
    echo "== $test: FAIL (tail of its log:)"; tail -20 "$OUT/$(basename "$test" .py).log"; failed=1
  fi
done
references=(dense)
$python -c 'import transformers' 2>/dev/null && references+=(transformers)
for model in $models; do
  for dtype in fp32 bf16; do
    for reference in "${references[@]}"; do
      log=$OUT/parity_${model}_${dtype}_cuda_$reference
      if $python -m managedkv.parity --model $model --dtype $dtype --device cuda \
          --reference "$reference" --json "$log.json" >"$log.log" 2>&1; then
        echo "== parity $model $dtype cuda $reference: PASS"; tail -1 "$log.log"
      else
        echo "== parity $model $dtype cuda $reference: FAIL"; tail -30 "$log.log"; failed=1
      fi
    done
  done
done
# The example engine with CUDA tensors: multi-turn chats, continuous batching, a pool that evicts.
for model in $models; do
  log=$OUT/engine_${model}_cuda
  if $python -m managedkv.engine --model $model --device cuda --pages 20 --verify \
      --expect evicted_records --json "$log.json" >"$log.log" 2>&1; then
    echo "== engine $model cuda: PASS"
  else
    echo "== engine $model cuda: FAIL"; tail -30 "$log.log"; failed=1
  fi
done
# FlexAttention (torch >= 2.5) over the pool's physical layout, through the physical-to-logical map.
if $python -c 'import torch.nn.attention.flex_attention' 2>/dev/null; then
  for model in $models; do
    log=$OUT/parity_${model}_fp32_cuda_flex
    if $python -m managedkv.parity --model $model --device cuda --attention flex \
        --reference dense --json "$log.json" >"$log.log" 2>&1; then
      echo "== parity $model fp32 cuda flex dense: PASS"; tail -1 "$log.log"
    else
      echo "== parity $model fp32 cuda flex dense: FAIL"; tail -30 "$log.log"; failed=1
    fi
  done
fi
# torch's fused scaled_dot_product_attention over the pages gathered through the views.
if $python -c 'import transformers' 2>/dev/null; then
  for model in $models; do
    for dtype in fp32 bf16; do
      log=$OUT/parity_${model}_${dtype}_cuda_sdpa
      if $python -m managedkv.parity --model $model --dtype $dtype --device cuda --attention sdpa \
          --reference transformers --json "$log.json" >"$log.log" 2>&1; then
        echo "== parity $model $dtype cuda sdpa transformers: PASS"; tail -1 "$log.log"
      else
        echo "== parity $model $dtype cuda sdpa transformers: FAIL"; tail -30 "$log.log"; failed=1
      fi
    done
  done
fi
exit $failed
