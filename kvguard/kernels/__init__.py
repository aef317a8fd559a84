"""kvguard's Triton kernels beside their torch references: the batched validation pass (``tag_check``, with
the write guard riding on it, ``write_guard``; ``graph_check``: the same check as a node of SGLang's decode CUDA
graphs), the decode recorder and the tag bump (``record``), and the direct launch
of their compiled variants that a server makes every step (``launch``).

It lives inside the ``kvguard`` package on purpose: there is no top-level ``kernels`` folder, so a bare
``import kernels`` never finds this repository (SGLang and transformers import the PyPI package
``kernels``). Modules here import only torch and triton. The engine's kernels (INT4 GEMM, FP8 KV store,
paged attention) belong to faultlab's engine: ``faultlab.engine.kernels``.
"""
