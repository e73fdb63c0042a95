"""RESULTS.md and its figures, written from the results the jobs recorded."""
