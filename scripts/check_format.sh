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
mapfile -t files < <(find src include kernels tests benchmarks examples python -type f \
  \( -name '*.h' -o -name '*.hpp' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \) \
  2>/dev/null | sort)
if ((${#files[@]} == 0)); then
  echo "check_format.sh: no C++ or CUDA sources under $root" >&2
  exit 2
fi
if (( fix )); then
  "$formatter" -i "${files[@]}"
  exit 0
fi
# One clang-format process for every file (a process per file took 30 s on 2 cores, this about 2).
# Each violation is a diagnostic naming its file, followed by the source line and a caret line;
# whatever else it printed (a broken .clang-format, a file it cannot read) is shown as it is.
violation=': error: code should be clang-formatted \[-Wclang-format-violations\]$'
diagnostics=$("$formatter" --dry-run -Werror "${files[@]}" 2>&1) && status=0 || status=$?
mapfile -t unformatted < <(grep -E "$violation" <<<"$diagnostics" | cut -d: -f1 | sort -u)
other=$(awk -v violation="$violation" '
  { line[NR] = $0 }
  END {
    for (i = 1; i <= NR; i++) {
      if (line[i] ~ violation) { if (line[i + 2] ~ /^ *\^/) i += 2; continue }
      if (line[i] != "") print line[i]
    }
  }' <<<"$diagnostics")
for file in "${unformatted[@]}"; do
  echo "not formatted: $file"
done
echo "${#files[@]} files checked, ${#unformatted[@]} not formatted"
if [[ -n $other ]] || ((status != 0 && ${#unformatted[@]} == 0)); then
  echo "check_format.sh: $formatter failed beyond formatting (status $status):" >&2
  echo "$other" >&2
  exit 2
fi
((status == 0))
