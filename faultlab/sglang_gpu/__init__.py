"""The GPU harness for real SGLang 0.5.23: kvguard in a live server on the H200 (issue 17).

Run ``python -m faultlab.sglang_gpu {overhead,faults,extras,report}`` (``--cpu``: a dry run on a CPU with a
tiny Llama, torch_native attention and short lengths); on the GPU machine after
``source bench/sglang_h200_setup.sh``. Modules:

* :mod:`.cli`: the argparse front and ``main``; :mod:`.__main__` runs it.
* :mod:`.common`: paths, the process environment (the plugin entry-point folder on ``PYTHONPATH``: the
  harness re-executes itself once when it is missing), engine settings, result files.
* :mod:`.workers`: one ``sglang.Engine`` per worker process, and the dist-info writer for entry points.
* :mod:`.workload`: the streamed request workload and its statistics (``summarize``, ``compare``).
* :mod:`.probes`: the ``kvguard_bench`` SGLang plugin (its entry point): the TP probes, and
  :mod:`.profiler`, kvguard's host time per iteration.
* :mod:`.overhead`, :mod:`.faults`, :mod:`.extras`: the GPU phases; :mod:`.report`: raw JSONs to
  ``bench/results/sglang_h200*.json`` and the plot.

Only the parts that run engines import SGLang, inside functions; matplotlib is imported by the plot only.
"""
