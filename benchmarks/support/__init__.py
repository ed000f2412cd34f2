"""Benchmark and test tooling that is not itself the matrix.

* :mod:`.vllm_peer`: stages vLLM's own DSV4 cache kernels as an importable package
  (the vLLM tests and ``benchmarks.vllm_peers`` use it);
* :mod:`.compile_sm90`: the offline sm_90 compile of the sparse MLA kernels
  (registers, spills), which the CPU suite runs;
* :mod:`.sparse_mla_variants`: the sparse MLA tile variants that the sweep times and
  the offline compile builds.

Tests may import these and the matrix's public pieces, never ``benchmarks.experiments``.
"""
