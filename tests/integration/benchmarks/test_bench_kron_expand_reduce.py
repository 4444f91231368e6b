"""``bench_kron_expand_reduce --quick``: both tables come back with sound numbers."""

import pytest
import torch

from integration.benchmarks import bench_kron_expand_reduce as bench


def _rows(text: str, section: str) -> list[list[str]]:
    part = text.split(section, 1)[1].split("\n## ", 1)[0]
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in part.splitlines()
        if line.startswith("| ") and not line.startswith(("| network", "| position_fraction"))
    ]


@pytest.fixture(scope="module")
def report() -> str:
    before = torch.get_default_dtype()
    text = bench.run(quick=True)
    assert torch.get_default_dtype() == before  # float64 inside run, restored after
    return text


@pytest.mark.slow
def test_pooled_errors_of_every_network_and_mode(report):
    rows = _rows(report, "## Pooled over the network")
    modes = {(r[0], r[1].split(" ")[0]) for r in rows}
    for net in ("tiny U-Net, CE", "U-Net, BCE, trained", "3-D net, CE"):
        assert {(net, "expand"), (net, "reduce"), (net, "reference:")} <= modes
    tiny = {r[1]: r for r in rows if r[0] == "tiny U-Net, CE"}
    # the factors' expectation is deterministic: the committed report's number
    assert tiny["expand"][2] == "0.441"
    assert any(k.startswith("laplace-torch + curvlinops") for k in tiny)
    for r in rows:
        if r[1] in ("expand", "reduce"):
            assert 0 <= float(r[2]) < 100
            assert 0 < float(r[4]) < 100


@pytest.mark.slow
def test_position_sampling_adds_an_error_below_one(report):
    rows = _rows(report, "## Position sampling")
    assert [r[0] for r in rows] == [f"1/{round(1 / f)}" for f in bench.FRACTIONS]
    for r in rows:
        mean = float(r[1].split(" ± ")[0])
        assert 0 < mean < 1
        assert float(r[2].split(" ")[0]) >= mean * 0.99  # the worst weight: at least the pooled
        assert "`" in r[2]  # names the weight
