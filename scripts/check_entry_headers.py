#!/usr/bin/env python3
"""Checks that the two entry headers of managedkv stay narrow (docs/architecture.md, "What is
public"): each of ENTRY_HEADERS may pull in at most LIMIT public headers, counted as the
transitive closure of its quoted `#include "mkv/..."` lines over the include/ tree (a header
reached twice counts once; the entry header itself and system or CUDA headers do not count).
Prints each entry header's count and closure; exit status 1 when one is over the limit, 2 when an
entry header is missing.

Usage: check_entry_headers.py [REPOSITORY_ROOT]   (default: the parent of this script's folder)
       check_entry_headers.py --self-test         (the check fails on a tree made too wide)
"""
import pathlib
import re
import sys
import tempfile

ENTRY_HEADERS = ("mkv/kv_cache_runtime.h", "mkv/managed_kv_cache_request.h")
LIMIT = 12

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def closure(include_root, header):
    """Every header under include_root that `header` (a path relative to it) reaches through
    quoted includes, `header` excluded; includes that name no file there are not followed."""
    seen, pending = set(), [header]
    while pending:
        name = pending.pop()
        path = include_root / name
        if name in seen or not path.is_file():
            continue
        seen.add(name)
        pending.extend(INCLUDE.findall(path.read_text(errors="replace")))
    seen.discard(header)
    return sorted(seen)


def main(root, entry_headers=ENTRY_HEADERS, limit=LIMIT):
    include_root = root / "include"
    missing = [h for h in entry_headers if not (include_root / h).is_file()]
    for header in missing:
        print(f"include/{header}: entry header not found")
    if missing:
        return 2
    over = 0
    for header in entry_headers:
        reached = closure(include_root, header)
        verdict = "ok" if len(reached) <= limit else f"more than {limit}"
        over += len(reached) > limit
        print(f"include/{header}: {len(reached)} public headers ({verdict}): "
              f"{', '.join(reached)}")
    print(f"{len(entry_headers)} entry headers checked, {over} over the limit of {limit}")
    return 1 if over else 0


def self_test():
    """Builds a tree whose first entry header reaches LIMIT + 1 headers (a chain and a diamond:
    each counted once) and the second exactly LIMIT; the check must fail on it, then pass once
    the chain is one shorter."""
    with tempfile.TemporaryDirectory() as directory:
        root = pathlib.Path(directory)
        mkv = root / "include" / "mkv"
        mkv.mkdir(parents=True)
        names = [f"mkv/h{i}.h" for i in range(LIMIT + 1)]
        for i, name in enumerate(names):
            following = f'#include "{names[i + 1]}"\n' if i + 1 < len(names) else ""
            # Every header also includes the last one and a system header: neither is recounted.
            (root / "include" / name).write_text(
                f'#pragma once\n#include <vector>\n#include "{names[-1]}"\n{following}')
        (root / "include" / ENTRY_HEADERS[0]).write_text(
            f'#include "{names[0]}"\n#include "{names[-1]}"\n#include "mkv/absent.h"\n')
        (root / "include" / ENTRY_HEADERS[1]).write_text(f'#include "{names[1]}"\n')
        counts = [len(closure(root / "include", h)) for h in ENTRY_HEADERS]
        wide = main(root)
        (root / "include" / names[-1]).unlink()
        narrow = main(root)
    if counts != [LIMIT + 1, LIMIT] or (wide, narrow) != (1, 0):
        print(f"self-test failed: closures of {counts} (want {[LIMIT + 1, LIMIT]}), exit {wide} on "
              f"the wide tree (want 1), {narrow} on the narrow one (want 0)")
        return 1
    print("self-test passed")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    default_root = pathlib.Path(__file__).resolve().parent.parent
    sys.exit(main(pathlib.Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else default_root))
