"""dfpo_bench: the benchmarks, studies and reports of dfpo-trl, a package apart from the library."""
