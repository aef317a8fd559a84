"""The engine's Triton kernels, each beside its torch reference (``<op>`` and ``<op>_ref``).

INT4 GEMM (``int4_gemm``), FP8 KV store (``kv_store``) and paged decode attention (``paged_attention``;
its argument checks and reference in ``paged_attention_ref``) run faultlab's engine under real FP8-KV /
INT4-weight load; ``testing`` holds the comparisons their tests use. kvguard's one kernel, the tag check,
lives with kvguard (``kvguard.kernels.tag_check``).

Like kvguard's, they live inside a package on purpose: there is no top-level ``kernels`` folder, so a bare
``import kernels`` never finds this repository (SGLang and transformers import the PyPI package
``kernels``). Modules here import only torch, triton and each other.
"""
