#!/usr/bin/env bash
# Set up a virtual environment with kvgate, its test tools and both routers (smg, sglang-router 0.3.2).
# Usage: scripts/setup.sh [VENV_DIR]   (default .venv). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kvgate needs Python >= 3.11")'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -e ".[test]"
# smg and sglang-router 0.3.2 both install a command named `smg`, and the one pip installs last wins: with
# sglang-router's, `smg launch` starts sgl-model-gateway 0.3.2 (`smg --version` tells them apart). Put smg's
# back. (kvgate's tests and benches run `python -m smg`, whichever command won.)
if ! "$VENV/bin/smg" --version 2>/dev/null | grep -q '^smg '; then
  smg_version="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("smg"))')"
  "$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps "smg==$smg_version"
fi
# Debian packages the tests run for real: each is installed only when its program is missing, needs root and
# apt-get, and its service is never left running (policy-rc.d denies the start during the install, then it is
# disabled): the tests and the bench start their own on 127.0.0.1. Without root the tests that need one skip.
#   prometheus    tests/test_prometheus_dashboard.py evaluates every dashboard query against a real Prometheus
#   redis-server  tests/test_replicas_redis.py: several kvgate replicas sharing state (state_backend: redis)
#   nginx-light, wrk  `kvgate bench-proxy` and tests/test_proxy_bench.py: nginx stands in for the engines with
#                 fixed answers, wrk is the load generator
# Usage: need_debian "what skips without it" SERVICE PACKAGE... -- PROGRAM...
need_debian() {
  local why="$1" service="$2" pkgs=() missing=""
  shift 2
  while [ "$1" != "--" ]; do pkgs+=("$1"); shift; done
  shift
  for prog in "$@"; do
    command -v "$prog" >/dev/null 2>&1 || [ -x "/usr/sbin/$prog" ] || [ -x "/usr/bin/$prog" ] || missing=1
  done
  [ -n "$missing" ] || return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: $* not found and not root (or no apt-get): install Debian's ${pkgs[*]}; $why" >&2
    return 0
  fi
  local policy_added=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && policy_added=1
  fi
  local install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}")
  "${install[@]}" >/dev/null || { apt-get update -q >/dev/null && "${install[@]}" >/dev/null; } \
    || echo "setup: WARNING: apt-get install ${pkgs[*]} failed; $why" >&2
  [ -z "$policy_added" ] || rm -f /usr/sbin/policy-rc.d
  # An old policy may still have let the package's service start (listening on every interface): stop it.
  if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    systemctl disable --now "$service" >/dev/null 2>&1 || true
  fi
}
need_debian "the Prometheus dashboard test will skip" prometheus prometheus -- prometheus
need_debian "the replica tests will skip" redis-server redis-server -- redis-server
need_debian "kvgate bench-proxy and its test will skip" nginx nginx-light wrk -- nginx wrk
touch "$VENV/.installed"
echo "setup: $VENV ready ($("$VENV/bin/python" --version); smg $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("smg"))'))"
