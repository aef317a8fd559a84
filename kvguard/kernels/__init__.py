"""Triton kernels of kvguard, each beside its torch reference (``<op>`` and ``<op>_ref``).

They live inside the ``kvguard`` package on purpose: there is no top-level ``kernels`` folder, so a bare
``import kernels`` never finds this repository (SGLang and transformers import the PyPI package
``kernels``). Modules here import only torch, triton and each other.
"""
