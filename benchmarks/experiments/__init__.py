"""Experiments: tile sweeps, profilers and one-off studies behind docs/attention.md's runs.

Not part of the benchmark matrix (``python -m benchmarks.kernels``) and imported by
no test: each module is a command of its own, ``python3 -m benchmarks.experiments.<name>``
(its docstring says what it measures and which documented run it produced).  They
may import the matrix (``benchmarks.inputs_sparse_mla``, ``benchmarks.harness``, ...)
and ``benchmarks.support``; nothing imports them.
"""
