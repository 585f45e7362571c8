#!/usr/bin/env bash
# Installs the Debian packages managedkv builds with (Debian 12 / Ubuntu 24.04), skipping the ones
# already present. Run as root (or prefix with sudo). The CUDA toolkit is optional: without nvcc the
# build is host-only (MKV_ENABLE_CUDA=AUTO). pybind11-dev and python3-dev build the Python module
# (MKV_PYTHON=AUTO), python3-torch and python3-numpy run its tests (docs/python.md). libhiredis-dev
# builds managedkv::remote (the remote tier on Redis). redis-server is run only by the tests, each
# starting a server of its own on a free 127.0.0.1 port (tests/support/redis_server.h); they never
# use a system service, and this script starts none (a service the Debian package may enable on
# port 6379 is not needed and can be disabled).
set -euo pipefail
packages=(cmake ninja-build g++ git pkg-config libgtest-dev libgmock-dev libbenchmark-dev
          libfmt-dev libspdlog-dev libxxhash-dev libssl-dev gnuplot-nox
          libzmq3-dev libmsgpack-cxx-dev python3 python3-zmq python3-msgpack
          libcli11-dev libsimdjson-dev nlohmann-json3-dev clang-format-14
          pybind11-dev python3-dev python3-torch python3-numpy
          libhiredis-dev redis-server)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$package")
done
if ((${#missing[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
