import csv
import time

import pytest

from lsn_ext.__main__ import main
from lsn_ext.demo import COLUMNS, MODELS


def test_quick_demo_writes_figure_and_tables(tmp_path, capsys):
    # CPU time of this process: wall-clock time depends on what else runs on the machine.
    start = time.process_time()
    assert main(["demo", "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    assert time.process_time() - start < 30
    assert (tmp_path / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(tmp_path / "table.csv") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == COLUMNS
    assert [r[0] for r in rows[1:]] == list(MODELS)
    for row in rows[1:]:
        assert all(float(v) >= 0 for v in row[1:])
    md = (tmp_path / "table.md").read_text()
    assert md.startswith("| " + " | ".join(COLUMNS) + " |")
    assert all(f"| {m} |" in md for m in MODELS)
    assert "Paper's ordering" in capsys.readouterr().out


def test_quick_demo_with_the_calibrated_estimator(tmp_path, capsys):
    args = ["demo", "--quick", "--out", str(tmp_path), "--no-progress", "--ensemble", "0"]
    assert main([*args, "--estimator", "db_calibrated", "--mc-samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "GGN diagonal: db_calibrated (2 Monte-Carlo vector(s) per image)" in out
    with open(tmp_path / "table.csv") as f:
        rows = list(csv.reader(f))
    assert [r[0] for r in rows[1:]] == [m for m in MODELS if m != "Ensemble"]


def test_demo_refuses_bad_estimator_options(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--estimator", "exact"])
    assert "invalid choice: 'exact'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--mc-samples", "0"])
    assert "--mc-samples >= 1" in capsys.readouterr().err
