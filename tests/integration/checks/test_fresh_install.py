"""integration/checks/fresh_install.py: its commands and report (the install needs the index)."""

import argparse
from pathlib import Path

from integration.checks import fresh_install as fresh


def test_the_install_commands_are_the_readmes_two_lines():
    venv = Path("/v")
    (_name1, first), (_name2, second) = fresh.install_steps(
        venv, "torch==2.13.0", "torchvision==0.28.0", "https://download.pytorch.org/whl/cpu", "."
    )
    assert first[-4:] == [
        "torch==2.13.0",
        "torchvision==0.28.0",
        "--index-url",
        "https://download.pytorch.org/whl/cpu",
    ]
    assert first[:4] == ["/v/bin/python", "-m", "pip", "install"]
    assert second[-1] == "."
    assert "--index-url" not in second
    (_, plain), _ = fresh.install_steps(venv, "torch==2.14.1", "torchvision==0.29.1", None, ".")
    assert "--index-url" not in plain


def test_the_checks_include_warnings_as_errors_and_the_quick_start(tmp_path):
    names = [name for name, _ in fresh.check_steps(Path("/v"), tmp_path / "q.py")]
    assert names == [
        "torchvision imports",
        "import, warnings as errors",
        "lsn-ext --version",
        "quick start",
    ]
    compile(fresh.QUICK_START, "quick_start.py", "exec")


def test_a_failed_step_is_reported_as_failed(tmp_path):
    steps = [
        fresh.Step("python -m venv", "python -m venv v", 2.0, True, ""),
        fresh.Step("quick start", "v/bin/python q.py", 9.0, False, "ImportError: torchvision"),
    ]
    args = argparse.Namespace(
        torch="torch==2.13.0", torchvision="torchvision==0.28.0", index_url=None, source_name="."
    )
    text = fresh.report(steps, "torch==2.13.0", 3 * 2**30, args)
    assert "a step FAILED" in text
    assert "| quick start | `v/bin/python q.py` | 9 | FAILED | ImportError: torchvision |" in text
    assert "3.00 GiB" in text
    steps[1].ok = True
    assert "every step passed." in fresh.report(steps, "", 0, args)


def test_a_step_records_its_result_without_raising(tmp_path):
    ok = fresh.run_step("true", ["python3", "-c", "print('fine')"], tmp_path)
    bad = fresh.run_step("false", ["python3", "-c", "raise SystemExit('broken')"], tmp_path)
    assert (ok.ok, ok.tail) == (True, "fine")
    assert (bad.ok, bad.tail) == (False, "broken")


def test_an_output_line_becomes_one_table_cell():
    assert fresh._cell("a | b") == "a \\| b"
    long = fresh._cell("x" * 500)
    assert len(long) == 160
    assert long.endswith("…")
