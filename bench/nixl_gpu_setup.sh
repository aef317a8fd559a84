# Source on the GPU machine, after bench/sglang_h200_setup.sh: NIXL (nixl-cu13 1.5.1's UCX backend) for SGLang's
# PD transfer backend. The wheel (59 MB) and the SGLang bundle together are over one call's 64 MiB, so
# bench/nixl_slim.sh makes .nixl/site here (what the UCX backend loads: ~32 MB, stripped) and a call carries it;
# this installs it once per machine (/tmp/nixl_site; it stays while the machine is warm, for the next call).
N=/tmp/nixl_site
if [ -d .nixl/site/nixl ]; then
  mkdir -p $N && cp -r .nixl/site/. $N/
elif [ ! -d $N/nixl ]; then
  echo "nixl_gpu_setup: no .nixl/site here (bench/nixl_slim.sh, carry .nixl)" >&2; return 1
fi
# nixl-cu13 links libcudart.so.13: torch's CUDA 13 runtime wheel holds it where the loader does not look
C=$(python3 -c 'import glob, os, torch; d = os.path.dirname(torch.__file__); print(":".join(sorted({os.path.dirname(p) for p in glob.glob(d + "/../nvidia/**/libcudart.so.13*", recursive=True)})))' 2>/dev/null)
export PYTHONPATH=$N${PYTHONPATH:+:$PYTHONPATH} LD_LIBRARY_PATH=${C:+$C:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
