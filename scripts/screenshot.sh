#!/usr/bin/env bash
# Screenshot a page (the Prefect UI) in headless Chromium: scripts/screenshot.sh URL OUT.png
# Needs Debian's chromium (apt-get install -y chromium).
set -euo pipefail
url=${1:-http://127.0.0.1:4200/runs}
out=${2:-runs/serve/ui.png}
mkdir -p "$(dirname "$out")"
profile=$(mktemp -d)
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --window-size=1600,1000 --virtual-time-budget=15000 \
  --screenshot="$out" "$url" >/dev/null 2>&1
rm -rf "$profile"
echo "$out"
