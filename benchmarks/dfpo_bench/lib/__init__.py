"""What the jobs share: records and provenance, statistics, timing, the trainers they build, vLLM helpers."""
