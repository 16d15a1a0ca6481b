"""Comparing two runs' records: what a run measures differs between any two runs, and
everything else it computes must agree."""

import re

import pytest

# What a run measures rather than computes: it differs between any two runs.
MEASURED = re.compile(r"(^|_)(s|seconds)$|tokens_per_s|measured_speedup|bandwidth|rss|"
                      r"per_process|over_weights|s_by_width|measured_s_by_site|best_measured|"
                      r"^speedup_(low|high)$|^dense_spread$|^verdict$|"
                      r"^best_dense(_choice)?$|^beside$|"  # chosen by timing the two dense paths
                      r"^(out|bases_dir|devices|processes|programs_compiled)$")


def assert_same_records(one, two, tolerances=None, path="", tolerance=1e-7):
  """`two` equals `one` but for MEASURED keys: floats to 1e-5 relative, or to an absolute
  tolerances[key] within that key; a key whose tolerance is None is not compared."""
  tolerances = tolerances or {}
  if isinstance(one, dict):
    assert one.keys() == two.keys(), path
    for key in one:
      if MEASURED.search(key) or (key in tolerances and tolerances[key] is None):
        continue
      assert_same_records(one[key], two[key], tolerances, f"{path}/{key}",
                          tolerances.get(key, tolerance))
  elif isinstance(one, list):
    assert len(one) == len(two), path
    for i, (a, b) in enumerate(zip(one, two)):
      assert_same_records(a, b, tolerances, f"{path}[{i}]", tolerance)
  elif isinstance(one, float) and isinstance(two, float):
    assert two == pytest.approx(one, rel=1e-5, abs=tolerance), path
  else:
    assert one == two, path
