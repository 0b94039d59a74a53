#!/usr/bin/env bash
# Installs what the search tests start themselves, when it is missing:
#   - PostgreSQL server binaries (tests/search/test_search_postgres.py runs initdb + postgres in a tmp dir)
#   - Chromium and chromedriver (tests/search/test_report_browser.py opens the HTML report headless)
# Debian/Ubuntu only (apt-get). Idempotent: when everything is there it returns at once without
# touching apt. Run as root (CI) or through sudo; `make test` runs it first.
set -euo pipefail

missing=()
# The server binaries live under /usr/lib/postgresql/<version>/bin (not on PATH on Debian).
if ! compgen -G "/usr/lib/postgresql/*/bin/postgres" >/dev/null \
    && ! command -v postgres >/dev/null 2>&1; then
    missing+=(postgresql)
fi
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    missing+=(chromium)
fi
if ! command -v chromedriver >/dev/null 2>&1; then
    missing+=(chromium-driver)
fi

if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-test-services: missing ${missing[*]} and no apt-get here; install them by hand" >&2
    exit 1
fi
sudo=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        sudo=(sudo)
    else
        echo "ensure-test-services: missing ${missing[*]}; run this script as root" >&2
        exit 1
    fi
fi

echo "ensure-test-services: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
