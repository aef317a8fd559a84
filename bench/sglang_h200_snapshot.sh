#!/usr/bin/env bash
# Build .snap/ (git-ignored): the COMMITTED project (kvguard, faultlab with the harness faultlab/sglang_gpu,
# pyproject.toml at REV, default HEAD) plus the working copies of the bench/sglang_h200* scripts, so a GPU
# run measures committed code even while others edit the checkout. Usage: bench/sglang_h200_snapshot.sh [REV] [EXTRA_PATH ...]
# EXTRA_PATH: working-tree paths to copy over the snapshot (e.g. faultlab/sglang_gpu before it is committed).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
REV=${1:-HEAD}; shift || true
grep -qx '/.snap/' .git/info/exclude || echo '/.snap/' >> .git/info/exclude
rm -rf .snap && mkdir -p .snap/bench
git archive "$REV" kvguard faultlab pyproject.toml | tar -x -C .snap
cp bench/sglang_h200.py bench/sglang_h200_setup.sh bench/sglang_h200_x2.sh .snap/bench/
for p in "$@"; do mkdir -p ".snap/$(dirname "$p")"; cp -r "$p" ".snap/$(dirname "$p")/"; done
find .snap -name __pycache__ -prune -exec rm -rf {} +
git rev-parse "$REV" > .snap/REVISION
du -sh .snap
