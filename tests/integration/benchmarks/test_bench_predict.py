"""``bench_predict --quick``: the table of time and memory per row comes back."""

import re

import pytest

from integration.benchmarks import bench_predict as bench


@pytest.mark.slow
def test_quick_run_measures_every_row():
    table = bench.run(quick=True)
    rows = [line for line in table.splitlines() if line.startswith("| small CNN")]
    assert len(rows) == 4  # nn and glm, two sample counts
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] in ("nn", "glm")
        assert float(cells[3]) > 0  # seconds
        assert re.fullmatch(r"-?\d+", cells[5])  # MB added
