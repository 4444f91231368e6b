"""The public API's annotations, as a type checker sees them from a user's script.

``tests/typing/public_api.py`` uses the public names and asserts their types; ``mypy --strict``
must accept it. The package's internals are not type-checked here (``--follow-imports=silent``):
what is checked is what a user's code sees of ``lsn_ext/__init__.py``'s exports.
"""

import subprocess
import sys
from pathlib import Path

import pytest

USAGE = Path(__file__).parent / "typing" / "public_api.py"


@pytest.mark.slow  # mypy --strict in a subprocess
def test_the_public_api_type_checks_strictly_from_a_users_script(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the dev extra")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(USAGE),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    assert done.stdout.startswith("Success: no issues found in 1 source file")
