#!/usr/bin/env python3
"""Checks that no layer of managedkv includes a higher one (docs/architecture.md, "Layers and
the direction of dependencies").

Every source and header under src/, kernels/ and include/mkv/ belongs to one layer: a file under
src/<layer>/ or kernels/ to that folder's layer, a public header under include/mkv/ to the layer
PUBLIC_HEADERS names (a new public header must be added there). Each quoted #include must name a
file of the same layer or of a layer the including layer may use (ALLOWED). Prints every
violation as `path:line: <layer> includes <header> (<layer>)`; exit status 1 when there is one,
2 when a file cannot be placed.

Usage: check_layers.py [REPOSITORY_ROOT]   (default: the parent of this script's folder)
"""
import pathlib
import re
import sys

# Which layers each layer may include, itself included (direct includes only).
ALLOWED = {
    "core": {"core"},
    "kernels": {"kernels", "core"},
    "resources": {"resources", "kernels", "core"},
    "swa": {"swa", "resources", "kernels", "core"},
    "context_cache": {"context_cache", "resources", "kernels", "core"},
    "events": {"events", "context_cache", "core"},
    "remote": {"remote", "core"},
    "runtime": {"runtime", "swa", "context_cache", "resources", "kernels", "core", "events"},
    "testing": {"testing", "runtime", "swa", "context_cache", "resources", "kernels", "core",
                "events"},
}

# Public headers (include/mkv/...) by layer; folders map as a whole.
PUBLIC_HEADERS = {
    "types.h": "core", "error.h": "core", "logging.h": "core", "tensor.h": "core",
    "cuda_types.h": "core", "stream.h": "core", "media.h": "core", "fault_site.h": "core",
    "generation_request.h": "core", "remote_kv_store.h": "core",
    "kernels.h": "kernels",
    "kv_cache_pool.h": "resources", "kv_page_table.h": "resources",
    "resident_slot_pool.h": "resources", "recurrent_state_pool.h": "resources",
    "snapshot_storage.h": "resources", "host_kv_tier.h": "resources",
    "swa_page_source.h": "resources", "attention_views.h": "resources",
    "request_handle.h": "resources",
    "bounded_swa_kv_page_manager.h": "swa", "bounded_swa_request.h": "swa",
    "context_cache/": "context_cache",
    "events/": "events",
    "remote/": "remote",
    "managed_kv_cache_request.h": "runtime", "kv_cache_runtime.h": "runtime",
    "sliding_reuse_request.h": "runtime", "tensor_parallel.h": "runtime",
    "testing/": "testing",
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
SOURCE_SUFFIXES = {".h", ".hpp", ".cuh", ".cpp", ".cu"}


def public_layer(relative):
    """Layer of include/mkv/<relative>, or None."""
    for key, layer in PUBLIC_HEADERS.items():
        if key.endswith("/") and relative.startswith(key) or relative == key:
            return layer
    return None


def layer_of(root, path):
    """Layer of a repository file, or None when it has none."""
    parts = path.relative_to(root).parts
    if parts[0] == "src" and len(parts) > 2 and parts[1] in ALLOWED:
        return parts[1]
    if parts[0] == "kernels":
        return "kernels"
    if parts[:2] == ("include", "mkv"):
        return public_layer("/".join(parts[2:]))
    return None


def resolve(root, including, name):
    """The repository file an include names (the build's include path: include/, src/,
    kernels/, then the including file's folder), or None for a header outside the tree."""
    for base in (root / "include", root / "src", root / "kernels", including.parent):
        candidate = base / name
        if candidate.is_file():
            return candidate
    return None


def main(root):
    files = [p for folder in ("src", "kernels", "include/mkv")
             for p in sorted((root / folder).rglob("*")) if p.suffix in SOURCE_SUFFIXES]
    violations, unplaced = [], []
    for path in files:
        layer = layer_of(root, path)
        if layer is None:
            if path.parts[len(root.parts)] != "src" or len(path.relative_to(root).parts) > 2:
                unplaced.append(path.relative_to(root))
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            match = INCLUDE.match(line)
            if not match:
                continue
            target = resolve(root, path, match.group(1))
            target_layer = layer_of(root, target) if target else None
            if target_layer is not None and target_layer not in ALLOWED[layer]:
                violations.append(f"{path.relative_to(root)}:{number}: {layer} includes "
                                  f"{match.group(1)} ({target_layer})")
    for path in unplaced:
        print(f"{path}: no layer (add it to PUBLIC_HEADERS or place it under src/<layer>/)")
    for violation in violations:
        print(violation)
    print(f"{len(files)} files checked, {len(violations)} upward include(s)")
    return 2 if unplaced else 1 if violations else 0


if __name__ == "__main__":
    default_root = pathlib.Path(__file__).resolve().parent.parent
    sys.exit(main(pathlib.Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else default_root))
