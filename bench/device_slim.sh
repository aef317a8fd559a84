#!/usr/bin/env bash
# The lent GPU machine takes at most 64 MiB of working tree per call (tracked files included); the raw H200
# results (bench/results/sglang_h200_raw, ~25 MiB) plus the SGLang bundle (.sgl, ~52 MiB) are more. Before a
# device call: `bench/device_slim.sh on` takes the raw results out of the index and ignores them (the files stay
# on disk; nothing is deleted), and installs a pre-commit hook that refuses every commit until
# `bench/device_slim.sh off` puts them back (a commit in between would delete them from the history's next tree).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
RAW=bench/results/sglang_h200_raw
EXCLUDE=.git/info/exclude HOOK=.git/hooks/pre-commit
case "${1:-}" in
  on)
    [ -e "$HOOK" ] && ! grep -q device_slim "$HOOK" && { echo "device_slim: $HOOK exists; not replacing it" >&2; exit 2; }
    git rm -r -q --cached --ignore-unmatch "$RAW"
    grep -qx "/$RAW/" "$EXCLUDE" 2>/dev/null || echo "/$RAW/" >> "$EXCLUDE"
    mkdir -p .git/hooks
    printf '#!/bin/sh\necho "device_slim is on: run bench/device_slim.sh off before committing" >&2\nexit 1\n' > "$HOOK"
    chmod +x "$HOOK"
    echo "device_slim on: $(git ls-files | xargs -d '\n' du -cb 2>/dev/null | tail -1 | cut -f1) bytes tracked" ;;
  off)
    sed -i "\#^/$RAW/\$#d" "$EXCLUDE"
    git add "$RAW"
    if [ -e "$HOOK" ] && grep -q device_slim "$HOOK"; then rm -f "$HOOK"; fi
    echo "device_slim off: $(git ls-files "$RAW" | wc -l) raw files tracked" ;;
  *) echo "usage: bench/device_slim.sh on|off" >&2; exit 2 ;;
esac
