"""``bench_predict --quick``: the table of time and memory per row comes back."""

import re

import pytest

from integration.benchmarks import bench_predict as bench


@pytest.mark.slow
def test_quick_run_measures_every_row():
    table = bench.run(quick=True)
    rows = [line for line in table.splitlines() if line.startswith("| small CNN")]
    cells_of = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert [(cells[1], cells[2]) for cells in cells_of] == [("nn", "4"), ("glm", "4")]
    for cells in cells_of:
        assert float(cells[3]) > 0  # seconds
        assert re.fullmatch(r"-?\d+", cells[5])  # MB added
