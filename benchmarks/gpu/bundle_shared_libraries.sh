#!/usr/bin/env bash
# Copies into BUNDLE/lib every shared library the bundle's executables load that the GPU machine's
# image may lack (libzmq and its dependency chain, Google Benchmark, libcrypto, ...): everything
# ldd resolves except the C runtime, libstdc++ and libgcc, which every image has (and which the
# portable build links statically where it can). run_on_device.sh puts BUNDLE/lib on
# LD_LIBRARY_PATH. Usage: bundle_shared_libraries.sh BUNDLE
set -euo pipefail
bundle=$1
mkdir -p "$bundle/lib"
system='^(linux-vdso|ld-linux|libc|libm|libmvec|libdl|librt|libpthread|libresolv|libutil|libstdc\+\+|libgcc_s)\.'
find "$bundle" -path "$bundle/lib" -prune -o -type f -perm -u+x -print | while read -r executable; do
  { ldd "$executable" 2>/dev/null || true; } | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  [[ $name =~ $system ]] && continue
  cp -L "$path" "$bundle/lib/$name"
done
