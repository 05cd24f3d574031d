"""``bench_decode.kernel_gaps``: the GPU timeline of a profiled decode call (busy time, idle gaps)."""

from __future__ import annotations

from triage.experiments.bench.bench_decode import GAP_US, kernel_gaps


def test_kernel_gaps_union_and_split_of_idle_time():
    spans = [(60.0, 70.0), (0.0, 10.0), (12.0, 20.0), (15.0, 25.0), (16.0, 18.0)]  # unsorted, overlapping
    g = kernel_gaps(spans)
    assert g["span"] == 70.0 and g["busy"] == 10.0 + 13.0 + 10.0
    assert (g["short"], g["n_short"]) == (2.0, 1)  # 10 → 12
    assert (g["long"], g["n_long"]) == (35.0, 1) and 35.0 >= GAP_US  # 25 → 60
    assert g["busy"] + g["short"] + g["long"] == g["span"]
