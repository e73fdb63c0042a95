"""dfpo_bench: the benchmarks, studies and reports of dfpo-trl, a package apart from the library.

It imports dfpo_trl only through its stable names (``dfpo_trl.__all__``) and ``dfpo_trl.testing``
(benchmarks/tests/test_imports.py walks every import); each job runs as ``python -m dfpo_bench.<kind>.<job>``.
"""
