#!/usr/bin/env bash
# Runs clang-tidy (Debian's clang-tidy-14, the checks of .clang-tidy, every one an error) over the
# host C++ sources of a configured build, from its compile_commands.json; exit status 1 on any
# finding. The sources:
#   * the .cpp files of src/, kernels/ and python/ the build compiles (the library, its test
#     engine and the Python bindings; their headers, include/ src/ kernels/, are checked through
#     them) whose translation unit changed since BASE: the file or any file it includes, as the
#     build's dependency record (`ninja -t deps`) lists them. Every one when the checks changed
#     (.clang-tidy, this script) or a file has no record (not built yet);
#   * the .cpp files of tests/ and benchmarks/ changed since BASE (committed or not): unless --base
#     names one, BASE is tests_base below (read from scripts/clang_tidy_base), a commit at which
#     CI had checked every library file and every test and benchmark file changed since lint came
#     in (00f462e) clean; a file touched
#     after it is checked again, so each stays clean from then on without CI re-reading the
#     unchanged ones;
#   * not .cu files (nvcc code), nor files this build does not compile (the GPU-only ones in a host
#     build): those are named and skipped.
# Paths listed in `deferred` (empty now) would have their .cpp files skipped and the findings in
# their headers listed without failing: for a path being restructured on another branch.
#
# Usage: run_clang_tidy.sh [--all] [--base REF] [BUILD_DIR]
#   BUILD_DIR  a configured tree (default build/default, the presets export compile_commands.json);
#              nothing needs building: the tree has no generated sources.
#   --all      every .cpp of src/, kernels/, tests/ and benchmarks/, deferred paths included
#              (their findings still listed apart).
#   --base REF tests/ and benchmarks/ changed since REF.
# Environment: MKV_TIDY_JOBS, parallel clang-tidy processes (default 2).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
all=0
base=
build=build/default
while (($#)); do
  case $1 in
    --all) all=1 ;;
    --base) base=${2:?--base needs a commit}; shift ;;
    -*) echo "run_clang_tidy.sh: unknown option $1" >&2; exit 2 ;;
    *) build=$1 ;;
  esac
  shift
done
cd "$root"
if [[ ! -f $build/compile_commands.json ]]; then
  echo "run_clang_tidy.sh: no $build/compile_commands.json (configure a preset first)" >&2
  exit 2
fi
build=$(cd "$build" && pwd)
tidy=$(command -v clang-tidy-14 || command -v clang-tidy || true)
if [[ -z $tidy ]]; then
  echo "run_clang_tidy.sh: clang-tidy-14 not found (scripts/install-deps.sh installs it)" >&2
  exit 2
fi

deferred='^$'
# Sources changed after the commit in scripts/clang_tidy_base are checked (library files: their
# translation unit). It was 00f462e (the merge that brought .clang-tidy to main), then 1fd71a6,
# 829638f, 5b93438, 670b4b3, 68026bb, 2cb20e9, then a38940d, each a commit whose CI run had
# checked every library file and every test and benchmark file changed since the previous base
# clean; move it only to such a commit. It lives in a file of its own so that moving it does not
# count as a change of this script (which checks every library file).
tests_base=$(tr -d '[:space:]' <"$root/scripts/clang_tidy_base")

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# The database clang-tidy reads: the build's, but for the precompiled test headers. GCC's .gch
# beside CMake's cmake_pch.hxx is not a PCH clang can read, and clang picks it up for
# "-include cmake_pch.hxx", so each test target's cmake_pch.hxx is included from a copy in $out.
# Prints the project's .cpp files that the database compiles, each with its object file.
mapfile -t compiled < <(python3 - "$build" "$root" "$out" <<'EOF'
import json, os, shlex, shutil, sys
build, root, out = sys.argv[1], sys.argv[2] + "/", sys.argv[3]
entries = json.load(open(os.path.join(build, "compile_commands.json")))
for index, entry in enumerate(entries):
    words = shlex.split(entry["command"]) if "command" in entry else entry["arguments"]
    for i, word in enumerate(words[:-1]):
        if word == "-include" and words[i + 1].endswith("/cmake_pch.hxx"):
            copy = os.path.join(out, "pch", str(index), "cmake_pch.hxx")
            os.makedirs(os.path.dirname(copy))
            shutil.copy(words[i + 1], copy)
            words[i + 1] = copy
    entry.pop("command", None)
    entry["arguments"] = [word for word in words if word != "-Winvalid-pch"]
    path = os.path.normpath(os.path.join(entry["directory"], entry["file"]))
    if path.startswith(root) and path.endswith(".cpp"):
        words = entry["arguments"]
        obj = words[words.index("-o") + 1] if "-o" in words[:-1] else ""
        print(path[len(root):] + "\t" + obj)
json.dump(entries, open(os.path.join(out, "compile_commands.json"), "w"))
EOF
)
declare -A in_build=() object_of=()
for line in "${compiled[@]}"; do
  in_build[${line%%$'\t'*}]=1
  object_of[${line%%$'\t'*}]=${line#*$'\t'}
done

if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "run_clang_tidy.sh: not a git checkout; src/ and kernels/ only" >&2
  mapfile -t files < <(find src kernels -name '*.cpp' | sort)
elif ((all)); then
  mapfile -t files < <(git ls-files 'src/*.cpp' 'kernels/*.cpp' 'python/*.cpp' 'tests/*.cpp' 'benchmarks/*.cpp')
else
  if [[ -z $base ]]; then
    base=$tests_base
  fi
  if [[ $(git rev-parse --is-shallow-repository) == true ]]; then
    echo "run_clang_tidy.sh: a shallow clone; tests changed since ${base:0:12} may be missed" >&2
  fi
  mapfile -t changed < <({ git diff --name-only "$base"; git ls-files --others --exclude-standard; } |
                         sort -u)
  library=()
  for file in $(git ls-files 'src/*.cpp' 'kernels/*.cpp' 'python/*.cpp'); do
    library+=("$file	${object_of[$file]:-}")
  done
  printf '%s\n' "${changed[@]}" >"$out/changed.txt"
  # The library files whose translation unit changed (python: the dependency records of the
  # build, read in one ninja call; the paths changed since BASE in changed.txt).
  mapfile -t files < <(
    python3 - "$build" "$root" "$out/changed.txt" "${library[@]}" <<'EOF'
import os, subprocess, sys
build, root, pairs = sys.argv[1], sys.argv[2] + "/", sys.argv[4:]
changed = set(line.strip() for line in open(sys.argv[3]) if line.strip())
files = [pair.split("\t")[0] for pair in pairs]
objects = {pair.split("\t")[0]: pair.split("\t")[1] for pair in pairs}
if changed & {".clang-tidy", "scripts/run_clang_tidy.sh"}:
    print("\n".join(files))
    sys.exit(0)
targets = sorted({o for o in objects.values() if o})
deps, current = {}, None
if targets:
    text = subprocess.run(["ninja", "-C", build, "-t", "deps", *targets], capture_output=True,
                          text=True).stdout
    for line in text.splitlines():
        if line and not line[0].isspace() and "#deps" in line and "(VALID)" in line:
            current = line.split(":")[0]
            deps[current] = []
        elif line and not line[0].isspace():
            current = None
        elif current is not None and line.strip():
            path = os.path.normpath(os.path.join(build, line.strip()))
            if path.startswith(root):
                deps[current].append(path[len(root):])
for file in files:
    record = deps.get(objects[file])
    if record is None or file in changed or any(dep in changed for dep in record):
        print(file)
EOF
    { git diff --name-only --diff-filter=d "$base" -- 'tests/*.cpp' 'benchmarks/*.cpp'
      git ls-files --others --exclude-standard -- 'tests/*.cpp' 'benchmarks/*.cpp'; } | sort -u)
fi
checked=()
not_run=0
for file in "${files[@]}"; do
  if [[ -z ${in_build[$file]:-} ]]; then
    echo "not compiled by this build, skipped: $file"
  elif ((!all)) && [[ $file =~ $deferred ]]; then
    ((++not_run))
  else
    checked+=("$file")
  fi
done
((not_run == 0)) || echo "$not_run files under the deferred paths not checked"

start=$SECONDS
mkdir "$out/log"
# One clang-tidy process per file, each file's output and exit status kept in $out. The build is
# GCC's: -Wno-unknown-warning-option for its -Wno-restrict.
printf '%s\n' "${checked[@]}" | xargs -r -P "${MKV_TIDY_JOBS:-2}" -I{} bash -c '
  log=$2/log/$(tr / _ <<<"$1")
  "$0" -p "$2" --quiet --extra-arg=-Wno-unknown-warning-option \
    --header-filter="^$3/(include/mkv|src|kernels)/" "$1" >"$log" 2>&1 && status=0 || status=$?
  echo "$status" >"$log.status"
' "$tidy" {} "$out" "$root"

diagnostic='^(/[^:]+):([0-9]+):[0-9]+: (warning|error): .* \[([^]]+)\]$'
failed=0
declare -A findings=() deferred_findings=()
for file in "${checked[@]}"; do
  log=$out/log/$(tr / _ <<<"$file")
  [[ $(cat "$log.status" 2>/dev/null) == 0 ]] && continue
  own=0
  while IFS= read -r line; do
    [[ $line =~ $diagnostic ]] || continue
    path=${BASH_REMATCH[1]#"$root"/}
    check=${BASH_REMATCH[4]%,-warnings-as-errors}
    entry="$path:${BASH_REMATCH[2]} $check"
    if [[ $path =~ $deferred && $check != clang-diagnostic-error ]]; then
      deferred_findings[$entry]=1
    else
      findings[$entry]=1
      own=1
    fi
  done <"$log"
  # A failed run without a finding outside the deferred paths fails too: the tool itself failed.
  if ((own)) || ! grep -qE "$diagnostic" "$log"; then
    failed=1
    echo "== $file"
    grep -vE '^[0-9]+ warnings?( and [0-9]+ errors?)? generated\.$' "$log" || true
  fi
done
if ((${#deferred_findings[@]})); then
  echo "deferred findings (paths being restructured elsewhere; not failing):"
  printf '  %s\n' "${!deferred_findings[@]}" | sort -V
fi
echo "clang-tidy: ${#checked[@]} files in $((SECONDS - start)) s, ${#findings[@]} findings," \
  "${#deferred_findings[@]} deferred"
((failed == 0))
