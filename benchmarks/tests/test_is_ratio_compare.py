"""The IS-ratio report's paragraph on the run before compares the two runs' rows field by field: it names a field
that differs."""

from __future__ import annotations

import copy
import json
import pathlib

from dfpo_bench.reports.report_trained import compare_lines, control_lines

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results" / "trained"


def test_the_comparison_names_the_fields_that_differ():
    first = json.loads((RESULTS / "is_ratio_truncated_support_before_head_dtype.json").read_text())
    latest = copy.deepcopy(first)
    assert "every row field identical" in compare_lines(first, latest)[0]
    latest["settings"]["recipe_32b"]["record"]["rows"]["sum_log_mass_product"][3] += 1e-6
    text = compare_lines(first, latest)[0]
    assert "32B recipe: T 0.6, top-p 0.95, top-k 20: differs in sum_log_mass_product" in text
    assert text.count("every row field identical") == 2


def test_the_control_paragraph_reads_its_record_and_the_32b_setting():
    control = json.loads((RESULTS / "is_ratio_untruncated_t06.json").read_text())
    latest = json.loads((RESULTS / "is_ratio_truncated_support.json").read_text())
    text = control_lines(control, latest)[0]
    ours = control["settings"]["untruncated_t06"]["slope_per_token"]["truncated_support"]
    assert f"slope {ours:.2g} [" in text and "main at fae533e" in text
    latest["settings"]["recipe_32b"]["slope_per_token"]["truncated_support"] = -0.5
    assert "truncated): -0.5 [" in control_lines(control, latest)[0]
