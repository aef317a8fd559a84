"""faultlab inside a real SGLang 0.5.23 server: a test-only plugin that corrupts page tables live.

* :mod:`.inject`: the SGLang plugin (entry point ``faultlab_inject``); registers nothing unless its
  environment variables are set. Its parts: :mod:`.plan` (the variables, fault classes and the parsed
  plan), :mod:`.strikes` (the hook bodies that arm entries and corrupt SGLang's pools; the spec, SWA and mamba
  strikes in :mod:`.path_strikes`, the helpers of every strike in :mod:`.strike_tools`), :mod:`.runtime`
  (per-process state and the JSON-lines log).
* :mod:`.cpu_rotary`: the torch rotary op SGLang needs on a plain CPU device (tests only).
* :mod:`.harness`: one ``sglang.Engine`` (CPU: a tiny dummy Llama) through fault episodes, in a process
  of its own (``python -m faultlab.sglang_live.harness SPEC OUT``); used by tests/test_faultlab/test_sglang_live/test_sglang_engine.py.
* :mod:`.sweep`: every class x seeds x SGLang configurations (``python -m faultlab.sglang_live.sweep``).

Imports SGLang only inside functions.
"""
