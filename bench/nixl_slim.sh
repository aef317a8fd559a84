#!/usr/bin/env bash
# .nixl/site: what NIXL's UCX backend loads from the nixl-cu13 1.5.1 wheel for CPython 3.12 (the GPU machine), for
# a device call to carry (bench/nixl_gpu_setup.sh installs it there): the Python packages nixl (the meta package)
# and nixl_cu13, the libraries their extension modules and the UCX plugin (.nixl_cu13.mesonpy.libs/plugins, where NIXL looks) need (readelf's NEEDED, followed), and
# UCX's CUDA and CMA transport modules; the other plugins (object stores, GDS, ...) stay out. Stripped: ~32 MB.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
W=$(mktemp -d); trap 'rm -rf $W' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d $W nixl-cu13==1.5.1 nixl==1.5.1
(cd $W && mkdir x m && unzip -q -d x nixl_cu13-*.whl && unzip -q -d m nixl-1.5.1-*.whl)
rm -rf .nixl && mkdir -p .nixl/site
grep -qx "/.nixl/" .git/info/exclude || echo "/.nixl/" >> .git/info/exclude
python3 - "$W" <<'PY'
import os, re, shutil, subprocess, sys
w = sys.argv[1]; dst = os.path.abspath(".nixl/site"); x = os.path.join(w, "x")
libs = {f: os.path.join(d, f) for d in ("nixl_cu13.libs", ".nixl_cu13.mesonpy.libs")
        for f in os.listdir(os.path.join(x, d)) if os.path.isfile(os.path.join(x, d, f))}
ucx = [f"nixl_cu13.libs/ucx/{f}" for f in os.listdir(os.path.join(x, "nixl_cu13.libs/ucx"))
       if f.endswith(".so.0.0.0") and ("cuda" in f or "cma" in f) and "perftest" not in f]
roots = [f"nixl_cu13/{f}" for f in os.listdir(os.path.join(x, "nixl_cu13"))] + [".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so"] + ucx
keep, todo = set(roots), [r for r in roots if ".so" in r]
while todo:
    out = subprocess.run(["readelf", "-d", os.path.join(x, todo.pop())], capture_output=True, text=True).stdout
    for n in re.findall(r"\(NEEDED\).*\[(.+)\]", out):
        if n in libs and libs[n] not in keep:
            keep.add(libs[n]); todo.append(libs[n])
for p in sorted(keep):
    os.makedirs(os.path.dirname(os.path.join(dst, p)), exist_ok=True)
    shutil.copy2(os.path.join(x, p), os.path.join(dst, p))
    if ".so" in p:
        subprocess.run(["strip", "--strip-unneeded", os.path.join(dst, p)], check=True)
for p in ("nixl/__init__.py", "nixl/_api.py", "nixl/logging.py", "nixl_meta_utils.py"):
    os.makedirs(os.path.dirname(os.path.join(dst, p)), exist_ok=True)
    shutil.copy2(os.path.join(w, "m", p), os.path.join(dst, p))
PY
echo "nixl_slim: $(du -sh .nixl | cut -f1) in .nixl/site"
