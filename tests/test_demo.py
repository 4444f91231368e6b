import csv
import time

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
