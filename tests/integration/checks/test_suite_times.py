"""``integration/checks/suite_times.py``: the per-test recorder and its per-file summary."""

import subprocess
import sys
from pathlib import Path

import pytest

from integration.checks import suite_times

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # pytest in a subprocess
def test_the_plugin_records_every_test_with_its_tier_and_cpu_seconds(tmp_path):
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\nmarkers =\n    slow: costly\n")
    (tmp_path / "test_a.py").write_text(
        "import time\nimport pytest\n\n@pytest.mark.slow\ndef test_s():\n"
        "    t = time.process_time()\n    while time.process_time() - t < 0.05:\n        pass\n\n"
        "def test_f():\n    pass\n"
    )
    out = tmp_path / "times.tsv"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "integration.checks.suite_times",
         f"--suite-times={out}", "-c", str(ini), "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=ROOT, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    rows, comments = suite_times.read(out)
    assert {r.nodeid.split("::")[1]: r.slow for r in rows} == {"test_s": True, "test_f": False}
    (slow,) = (r for r in rows if r.slow)
    assert slow.cpu >= 0.05
    assert slow.wall >= 0.05
    assert comments[0].startswith("load average (1, 5, 15 min): start ")
    assert "| slow | 1 |" in suite_times.report(rows, comments, top=5)


def test_durations_output_is_summed_per_test_and_ranked_per_file(tmp_path):
    durations = tmp_path / "durations.txt"
    durations.write_text(
        "# a line a test printed\n"
        "===== slowest durations =====\n"
        "0.50s call     tests/a.py::test_one\n"
        "0.25s setup    tests/a.py::test_one\n"
        "1.00s call     tests/b.py::test_two[x]\n"
        "(3 durations < 0.005s hidden.)\n"
    )
    rows, comments = suite_times.read(durations)
    assert comments == [
        "pytest --durations output: wall seconds of the phases it lists (not those < 0.005 s)"
    ]
    assert sorted((r.nodeid, r.wall, r.cpu) for r in rows) == [
        ("tests/a.py::test_one", 0.75, None),
        ("tests/b.py::test_two[x]", 1.0, None),
    ]
    md = suite_times.report(rows, [], top=5)
    assert "| all | 2 | – | 1.8 |" in md
    assert "fast" not in md.split("Top", 1)[0]  # no tier without the plugin's records
    assert md.index("| tests/b.py | 1 |") < md.index("| tests/a.py | 1 |")
