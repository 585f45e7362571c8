#!/usr/bin/env bash
# Checks that every C++ and CUDA source of the repository is formatted by .clang-format
# (clang-format 14, Debian's clang-format-14): prints the files that are not, exit status 1 when
# there is one. Reformat with: scripts/check_format.sh --fix
# Usage: check_format.sh [--fix] [REPOSITORY_ROOT]
set -euo pipefail
fix=0
if [[ ${1:-} == --fix ]]; then
  fix=1
  shift
fi
root=${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
cd "$root"
formatter=$(command -v clang-format-14 || command -v clang-format || true)
if [[ -z $formatter ]]; then
  echo "check_format.sh: clang-format-14 not found (scripts/install-deps.sh installs it)" >&2
  exit 2
fi
mapfile -t files < <(find src include kernels tests benchmarks examples -type f \
  \( -name '*.h' -o -name '*.hpp' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \) \
  2>/dev/null | sort)
if (( fix )); then
  "$formatter" -i "${files[@]}"
  exit 0
fi
unformatted=0
for file in "${files[@]}"; do
  if ! "$formatter" --dry-run -Werror "$file" >/dev/null 2>&1; then
    echo "not formatted: $file"
    unformatted=$((unformatted + 1))
  fi
done
echo "${#files[@]} files checked, $unformatted not formatted"
(( unformatted == 0 ))
