"""faultlab inside a real SGLang 0.5.23 server: a test-only plugin that corrupts page tables live.

* :mod:`.inject`: the SGLang plugin (entry point ``faultlab_inject``); registers nothing unless its
  environment variables are set.
* :mod:`.cpu_rotary`: the torch rotary op SGLang needs on a plain CPU device (tests only).
* :mod:`.harness`: starting ``sglang.Engine`` on the CPU with a tiny dummy Llama, for tests.

Imports SGLang only inside functions.
"""
