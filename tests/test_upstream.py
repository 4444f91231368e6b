"""The StochMan patches of ``integration/upstream`` apply to the installed release and pass."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "integration" / "upstream" / "check.py"
PATCHES = sorted((ROOT / "integration" / "upstream" / "stochman").glob("[0-9]*.patch"))

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None and shutil.which("patch") is None,
    reason="check.py applies the patches with git or patch; neither is installed",
)


def test_stochman_patches_apply_and_pass():
    res = subprocess.run(
        [sys.executable, str(CHECK), "stochman"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {
        m.group(1): m.group(2, 3, 4)
        for m in re.finditer(
            r"^\| stochman \| `([^`]+)` \| (\S+) \| (\S+) \| (\d+) / 0 / ", res.stdout, re.M
        )
    }
    assert sorted(rows) == [p.name for p in PATCHES], res.stdout
    for name, (applies, passes, n_passed) in rows.items():
        assert (applies, passes) == ("yes", "yes"), f"{name}: {res.stdout}"
        assert int(n_passed) > 0, f"{name} ran no tests"
