"""``bench_volume --quick``: the 3-D Laplace workflow runs and its report is sound."""

import re
import subprocess

import pytest

from integration.harness import script_command, script_env

pytest.importorskip("monai", reason="MONAI's BasicUNet is the benchmark's network")
pytestmark = pytest.mark.slow  # one --quick run of the script in a subprocess


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("bench_volume")
    # one torch thread, as in the suite (tests/conftest.py): on the busy 2-core machine the
    # default second OpenMP thread mostly spin-waited, over twice the CPU seconds (CHANGELOG)
    args = ("--quick", "--threads", "1", "--out", str(out))
    subprocess.run(
        script_command("integration.benchmarks.bench_volume", *args),
        env=script_env(),
        check=True,
        capture_output=True,
        timeout=600,
    )
    return (out / "bench_volume.md").read_text()


def test_every_stage_has_a_positive_time_and_memory(report):
    rows = [ln for ln in report.splitlines() if ln.startswith("| ") and "stage" not in ln]
    stages = [r.split("|")[1].strip() for r in rows]
    assert [s.split(" ")[0] for s in stages] == ["training", "Laplace.fit", "marglik", "predict,"]
    for row in rows:
        seconds, mib, ratio = (float(c) for c in row.split("|")[2:5])
        assert seconds > 0
        assert mib >= 0
        assert ratio >= 0
    assert rows[0].split("|")[4].strip() == "1.00"


def test_the_header_names_the_network_the_volumes_and_the_prior(report):
    assert "MONAI BasicUNet 3-D" in report
    assert "3 synthetic volumes of 32³" in report
    prior = float(re.search(r"chosen by marglik: ([0-9.e+-]+)\.", report).group(1))
    assert prior > 0
