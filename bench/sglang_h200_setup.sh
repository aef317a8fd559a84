# Source this on the GPU machine, from the folder holding the project tree to run (see
# bench/sglang_h200_snapshot.sh), before `python3 -m faultlab.sglang_gpu ...`. It installs the offline
# SGLang 0.5.23 bundle (../shared/tools/sglang-h200/build.sh; the folder is $SGL_BUNDLE, default .sgl)
# once per machine, sets the variables SGLang needs there (../shared/reference/sglang-on-h200.md), and
# puts on PYTHONPATH the project and the folder where the harness declares SGLang's plugin entry points
# (faultlab.sglang_gpu.common.EP_DIR: it must be on sys.path from the start of every process).
# The tree plus .sgl is over the device's 64 MiB: bench/device_slim.sh on before a call, off after.
SGL_BUNDLE=${SGL_BUNDLE:-.sgl}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
S=/tmp/sgl_site
if [ ! -d $S/sglang ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target $S "$SGL_BUNDLE"/wheels/*.whl || return 1
  # Llama's MLP imports the CuTe-DSL dual GEMM (cutlass, not in the bundle) on CUDA: turn that optional kernel off.
  sed -i 's/        if not is_cuda():/        if True:  # no cutlass-dsl here/' $S/sglang/srt/layers/dual_gemm.py
fi
EP=$(PYTHONPATH=$PWD python3 -c 'from faultlab.sglang_gpu.common import EP_DIR; print(EP_DIR)') || return 1
# bench/gpu_shims: import-only stand-ins for kernel packages the bundle lacks (flash_mla: SGLang's EAGLE v2 worker
# imports it on every CUDA start; the Triton backend never calls it).
export PYTHONPATH=$PWD:$EP:$S:$PWD/bench/gpu_shims${PYTHONPATH:+:$PYTHONPATH}
