"""``bench_lowrank_cost --quick``: cost per rank, with positive times and ratios."""

import pytest
import torch

from integration.benchmarks import bench_lowrank_cost as bench


@pytest.mark.slow
def test_quick_run_times_every_rank():
    # float32 as in `./dev bench lowrank_cost --quick` (the suite's default is float64, which
    # made this run 1.7 times the CPU seconds); the fixture of tests/conftest.py restores it
    torch.set_default_dtype(torch.float32)
    text = bench.run(quick=True)
    assert "Written by `./dev bench lowrank_cost --quick`." in text
    assert "Load average before:" in text
    per_rank = [line for line in text.splitlines() if line.startswith(("| 2 |", "| 4 |"))]
    assert len(per_rank) == 2
    for line in per_rank:
        cells = [c.strip() for c in line.strip("|").split("|")]
        steps, cpu, wall = int(cells[1]), float(cells[2]), float(cells[3])
        assert steps == 2 * int(cells[0]) + 10  # the default Lanczos steps
        assert cpu > 0
        assert wall > 0
        assert float(cells[5]) > 0  # fit / epoch
    product = next(ln for ln in text.splitlines() if ln.startswith("| one GGN-vector product"))
    assert float(product.split("|")[-2]) > 0
