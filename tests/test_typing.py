"""The public API's annotations, as a type checker sees them from a user's script.

``tests/typing/public_api.py`` uses the public names and asserts their types; ``mypy --strict``
must accept it. The package's internals are not type-checked here (``--follow-imports=silent``):
what is checked is what a user's code sees of ``lsn_ext/__init__.py``'s exports.

mypy keeps its incremental cache in the checkout's ``.mypy_cache`` (its default folder, which
it git-ignores itself): the first run analyses torch's stubs, nearly all of the cost; later runs
re-analyse only what changed (mypy compares each cached module's source and options).
"""

import subprocess
import sys
from pathlib import Path

import pytest

USAGE = Path(__file__).parent / "typing" / "public_api.py"
CACHE = Path(__file__).resolve().parents[1] / ".mypy_cache"


@pytest.mark.slow  # mypy --strict in a subprocess
def test_the_public_api_type_checks_strictly_from_a_users_script():
    pytest.importorskip("mypy", reason="mypy is in the dev extra")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",
            "--cache-dir",
            str(CACHE),
            str(USAGE),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    assert done.stdout.startswith("Success: no issues found in 1 source file")
