"""``bench_speed --quick``: every method × network row, finite positive ratios; the Kron fits
beside laplace-torch + curvlinops, which apply to the 2-class U-Net only."""

import math
import re
import subprocess

import pytest

from integration.benchmarks import bench_speed as bench
from integration.harness import script_command, script_env

METHODS = (
    "training step",
    "lsn_ext DB",
    "lsn_ext MC(1)",
    "BackPACK DiagGGNMC",
    "BackPACK DiagGGNExact",
    "curvlinops hutchinson_diag(GGN, 1)",
)
NETWORKS = ("paper U-Net 32²", "MONAI BasicUNet 2-D 32²", "MONAI BasicUNet 3-D 32³")


def _rows(section: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| network")
    ]


@pytest.fixture(scope="module")
def report() -> str:
    # A subprocess: the script runs in float32, the suite's default dtype is float64.
    out = subprocess.run(
        script_command(bench.__name__, "--quick", "--threads", "1"),
        env=script_env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=1200,
    )
    return out.stdout.split("## Speed and memory", 1)[1]


@pytest.mark.slow
def test_time_table_has_every_method_and_network(report):
    time_part = report.split("### Time", 1)[1].split("### Peak memory", 1)[0]
    rows = {(r[0].split(",")[0], r[1]): r for r in _rows(time_part)}
    assert set(rows) == {(n, m) for n in NETWORKS for m in METHODS}
    for (net, method), cells in rows.items():
        if cells[2].startswith("fails: "):  # a peer that fails says why
            assert not method.startswith(("training", "lsn_ext")), (net, method, cells[2])
            assert len(cells[2]) > len("fails: set-up: ")
            continue
        assert float(cells[2]) > 0
        ratio = float(cells[3])
        assert 0 < ratio < math.inf
        low, high = map(float, cells[4].split("–"))  # one process: its median is the ratio
        assert low == high == ratio
        assert int(cells[5]) >= 1
    assert all(rows[n, "training step"][3] == "1.00" for n in NETWORKS)


@pytest.mark.slow
def test_memory_table_has_positive_peaks_and_ratios(report):
    memory_part = report.split("### Peak memory relative", 1)[1].split("###", 1)[0]
    rows = _rows(memory_part)
    assert [(r[0].split(",")[0], r[1]) for r in rows] == [
        ("MONAI BasicUNet 3-D 32³", m) for m in ("training step", "lsn_ext DB", "lsn_ext MC(1)")
    ]
    for cells in rows:
        assert float(cells[2]) > 0  # MiB above the baseline
        ratio = float(cells[3])
        assert 0 < ratio < math.inf


@pytest.mark.slow
def test_header_records_torch_threads_device_and_load(report):
    header = report.split("### Time", 1)[0]
    assert "torch threads 1" in header
    assert "Device: cpu." in header
    assert "Load average (1, 5, 15 min) at the start" in header
    assert "Command: `./dev bench speed --quick" in header
    assert "Smoke run (--quick): the time cases of both parts share one worker process" in header
    assert re.search(r"Code: [0-9a-f]{7,}", header)


def test_time_cases_pool_their_processes_and_keep_each_median(monkeypatch):
    runs = iter(
        [
            [{"train": {"times": [1.0, 1.0], "ratios": [1.0, 1.0]},
              "db": {"times": [1.1, 1.3], "ratios": [1.1, 1.3]},
              "peer": {"error": "set-up: no"}}],
            [{"train": {"times": [2.0], "ratios": [1.0]},
              "db": {"times": [2.4], "ratios": [1.2]},
              "peer": {"times": [3.0], "ratios": [1.5]}}],
        ]
    )  # fmt: skip
    monkeypatch.setattr(bench, "_run_time_worker", lambda *args: next(runs))
    case = bench.Case("unet", 32, 2, True, "cpu")
    [(timed, pooled)] = bench._timed_cases([(case, 2, 2, 2)])
    assert timed == case
    assert pooled["db"]["ratios"] == [1.1, 1.3, 1.2]
    assert pooled["db"]["medians"] == pytest.approx([1.2, 1.2])
    assert pooled["train"]["times"] == [1.0, 1.0, 2.0]
    assert pooled["peer"] == {"error": "set-up: no"}  # failing in one process is failing


def _fake_time_worker(calls: list):
    def worker(group, shown):
        calls.append([case.net for case, *_ in group])
        return [{"train": {"times": [float(i)], "ratios": [1.0]}} for i in range(len(group))]

    return worker


def test_quick_time_cases_share_one_worker_and_full_size_ones_do_not(monkeypatch):
    calls: list[list[str]] = []
    monkeypatch.setattr(bench, "_run_time_worker", _fake_time_worker(calls))
    quick = [bench.Case(net, 32, 2, True, "cpu") for net in ("unet", "basicunet2d")]
    out = list(bench._timed_cases([(case, 2, 2, 1) for case in quick]))
    assert calls == [["unet", "basicunet2d"]]  # one process, the cases in order
    assert [case for case, _ in out] == quick
    assert [r["train"]["times"] for _, r in out] == [[0.0], [1.0]]  # each its own result
    calls.clear()
    full = [bench.Case(net, 64, 8, False, "cpu") for net in ("unet", "basicunet2d")]
    assert [case for case, _ in bench._timed_cases([(case, 10, 2, 2) for case in full])] == full
    assert calls == [["unet"], ["unet"], ["basicunet2d"], ["basicunet2d"]]  # fresh ones per case
    calls.clear()
    list(bench._timed_cases([(case, 2, 2, 3) for case in quick]))  # --quick --processes 3
    assert calls == [["unet"]] * 3 + [["basicunet2d"]] * 3


@pytest.mark.parametrize("quick", [True, False], ids=["quick-one-process", "full-one-per-cell"])
def test_memory_cells_run_in_a_process_each_unless_quick(monkeypatch, quick):
    calls = []

    def run_worker(module, flag, spec, extra_env):
        assert flag == "--_memory-worker"
        assert extra_env == bench.MALLOC_ENV  # the RSS follows the live tensors
        calls.append([(cell["case"]["net"], cell["method"]) for cell in spec])
        return [], [{"peak_increase": 10 * len(calls) + i} for i in range(len(spec))]

    monkeypatch.setattr(bench, "run_worker", run_worker)
    net3d, unet = (bench.Case(net, 32, 1, quick, "cpu") for net in ("basicunet3d", "unet_ce"))
    cells = [(net3d, bench.MEMORY_METHODS), (unet, ("train", "kron_reduce"))]
    measured = bench._measured_cases(cells)
    first = next(measured)
    assert len(calls) == 1 if quick else 3  # lazy: the second case has not run yet
    out = [first, *measured]
    assert [(case, list(results)) for case, results in out] == [(c, list(m)) for c, m in cells]
    wanted = [(c.net, m) for c, methods in cells for m in methods]
    assert calls == ([wanted] if quick else [[cell] for cell in wanted])
    peaks = [r["peak_increase"] for _, results in out for r in results.values()]
    assert peaks == ([10, 11, 12, 13, 14] if quick else [10, 20, 30, 40, 50])


KRON_NETWORKS = ("paper U-Net 32²", "paper U-Net, 2 classes (CE) 32²", "MONAI BasicUNet 3-D 32³")


@pytest.mark.slow
def test_kron_table_has_ours_everywhere_and_curvlinops_where_it_applies(report):
    part = report.split("### Kron fit", 1)[1].split("###", 1)[0]
    rows = {(r[0].rsplit(", batch", 1)[0], r[1]): r for r in _rows(part)}
    assert set(rows) == {(n, m) for n in KRON_NETWORKS for m in bench.KRON_METHODS.values()}
    for (net, method), cells in rows.items():
        if method.startswith("laplace-torch"):
            if net.startswith("paper U-Net,"):  # the 2-class U-Net: curvlinops runs
                assert float(cells[3].split(" ")[0]) > 0
            elif net.startswith("paper U-Net"):  # BCE: laplace-torch has no such likelihood
                assert cells[2].startswith("not run: laplace-torch has no Bernoulli")
            else:  # Conv3d: curvlinops refuses it, and the row says why
                assert cells[2].startswith("fails: ")
            continue
        assert float(cells[2]) > 0  # wall ms
        for ratio in (cells[3], cells[4]):  # "median (min–max)", wall and CPU
            median, low, high = map(float, ratio.replace("(", "").replace(")", "")
                                    .replace("–", " ").split())  # fmt: skip
            assert 0 < low <= median <= high < math.inf
        assert int(cells[5]) >= 1
    assert all(rows[n, "training step"][3].startswith("1.00") for n in KRON_NETWORKS)


@pytest.mark.slow
def test_kron_memory_table(report):
    part = report.split("### Peak memory of a Kron fit", 1)[1].split("Total benchmark", 1)[0]
    assert "no GPU here" in part or "max_memory_allocated()` −" in part
    rows = _rows(part)
    assert [r[1] for r in rows] == list(bench.KRON_METHODS.values())
    for cells in rows:
        assert float(cells[2]) > 0
        assert float(cells[3]) > 0
        factors = float(cells[4])  # MiB of the returned Kron factors: none for the step
        assert factors == 0 if cells[1] == "training step" else factors > 0
