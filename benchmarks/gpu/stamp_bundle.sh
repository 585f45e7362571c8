#!/usr/bin/env bash
# stamp_bundle.sh SOURCE_DIR BUNDLE_DIR: writes BUNDLE_DIR/COMMIT, the source tree's commit when
# the bundle was copied (git describe --always --dirty; "unknown" outside a git checkout), so
# that a GPU run names the code it ran, not whatever checkout the GPU machine was handed.
set -u
commit=$(git -C "$1" describe --always --dirty 2>/dev/null) || commit=unknown
printf '%s\n' "${commit:-unknown}" >"$2/COMMIT"
