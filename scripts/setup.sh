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
# Prometheus (Debian's package) for tests/test_prometheus_dashboard.py: it evaluates every dashboard query
# against a real Prometheus. Skipped when prometheus is already on PATH; needs root and apt-get. The package's
# service is not started (policy-rc.d denies it during the install): the test starts its own on 127.0.0.1.
if ! command -v prometheus >/dev/null 2>&1 && [ ! -x /usr/bin/prometheus ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    POLICY_ADDED=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && POLICY_ADDED=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt_install_prometheus() { apt-get install -y -q --no-install-recommends prometheus >/dev/null; }
    apt_install_prometheus || { apt-get update -q >/dev/null && apt_install_prometheus; } \
      || echo "setup: WARNING: apt-get install prometheus failed; the Prometheus dashboard test will skip" >&2
    [ -z "$POLICY_ADDED" ] || rm -f /usr/sbin/policy-rc.d
    # Debian's init script may still have been run by an old policy; never leave a system prometheus behind
    # (the package's own service listens on every interface).
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
      systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
  else
    echo "setup: prometheus not found and not root (or no apt-get): install Debian's prometheus package" \
         "to run the Prometheus dashboard test" >&2
  fi
fi
# redis-server (Debian's package) for tests/test_replicas_redis.py: several kvgate replicas sharing state
# (state_backend: redis). The tests start their own redis-server on 127.0.0.1 and skip without it. The package's
# service is not started (policy-rc.d) and is disabled: it would listen on port 6379 for everyone.
if ! command -v redis-server >/dev/null 2>&1 && [ ! -x /usr/bin/redis-server ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    POLICY_ADDED=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && POLICY_ADDED=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt_install_redis() { apt-get install -y -q --no-install-recommends redis-server >/dev/null; }
    apt_install_redis || { apt-get update -q >/dev/null && apt_install_redis; } \
      || echo "setup: WARNING: apt-get install redis-server failed; the replica tests will skip" >&2
    [ -z "$POLICY_ADDED" ] || rm -f /usr/sbin/policy-rc.d
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
      systemctl disable --now redis-server >/dev/null 2>&1 || true
    fi
  else
    echo "setup: redis-server not found and not root (or no apt-get): install Debian's redis-server package" \
         "to run the replica tests" >&2
  fi
fi
# nginx and wrk (Debian's nginx-light and wrk) for `kvgate bench-proxy` and tests/test_proxy_bench.py: nginx
# stands in for the engines with fixed answers, wrk is the load generator. The bench and its test skip without
# them. The package's nginx service is not started (policy-rc.d) and is disabled: the bench runs its own.
if ! command -v wrk >/dev/null 2>&1 || { ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    POLICY_ADDED=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && POLICY_ADDED=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt_install_bench() { apt-get install -y -q --no-install-recommends nginx-light wrk >/dev/null; }
    apt_install_bench || { apt-get update -q >/dev/null && apt_install_bench; } \
      || echo "setup: WARNING: apt-get install nginx-light wrk failed; kvgate bench-proxy will skip" >&2
    [ -z "$POLICY_ADDED" ] || rm -f /usr/sbin/policy-rc.d
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
      systemctl disable --now nginx >/dev/null 2>&1 || true
    fi
  else
    echo "setup: nginx or wrk not found and not root (or no apt-get): install Debian's nginx-light and wrk" \
         "to run kvgate bench-proxy" >&2
  fi
fi
touch "$VENV/.installed"
echo "setup: $VENV ready ($("$VENV/bin/python" --version); smg $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("smg"))'))"
