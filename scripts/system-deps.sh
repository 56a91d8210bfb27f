#!/usr/bin/env bash
# System packages some tests need besides the Python ones `make venv` installs: libfaketime
# (tests/e2e/test_clock_skew.py runs a control-plane replica 30 s ahead) and chromium (the
# dashboard test drives Debian's chromium with Playwright, which cannot download its own browser
# here). Needs root and apt-get; elsewhere it says what is missing, exits 1, and those tests skip.
set -euo pipefail

missing=()
[[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ]] && command -v faketime >/dev/null || missing+=(faketime)
command -v chromium >/dev/null || missing+=(chromium)

if (( ${#missing[@]} == 0 )); then
  echo "system deps: all present"
  exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
  echo "system deps: missing ${missing[*]} (install them with apt-get as root); the tests that need them skip" >&2
  exit 1
fi
echo "system deps: apt-get install ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
