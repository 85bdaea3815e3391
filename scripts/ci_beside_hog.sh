#!/usr/bin/env bash
# The whole suite as CI runs it (.ci/run: the README's test command on a fresh clone) beside a CPU hog that keeps
# one core busy, as a shared CI machine would: a test that loses a race there is a broken test.
#   scripts/ci_beside_hog.sh DIR [REPO]   clones REPO (default: this checkout) into DIR, runs CI=true .ci/run
# there with `python3 -c "while True: pass"` in its own process group beside it, writes DIR.log and prints
# "rc=N seconds=S". The hog is stopped by its group id whatever happens.
set -u
dir=${1:?usage: scripts/ci_beside_hog.sh DIR [REPO]}
repo=${2:-$(cd "$(dirname "$0")/.." && pwd)}
rm -rf "$dir" && git clone -q "$repo" "$dir" && cd "$dir" || exit 1
setsid python3 -c "while True: pass" &
hog=$!
trap 'kill -- -"$hog" 2>/dev/null' EXIT
start=$(date +%s)
CI=true bash .ci/run > "$dir.log" 2>&1
rc=$?
echo "rc=$rc seconds=$(( $(date +%s) - start ))" | tee -a "$dir.log"
exit $rc
