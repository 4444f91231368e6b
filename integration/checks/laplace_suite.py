"""laplace-torch's own test suite with ``lsn_ext.DiagBackprop`` substituted (issue 25).

Usage::

    .venv/bin/python -m integration.checks.laplace_suite --laplace-tests PATH
        [--modes baseline mc db] [--out integration/results] [-k EXPR]

``PATH`` is a checkout of laplace-torch's repository (the folder that holds ``tests/``; the
test files import ``tests.utils``). The release's source distribution ships no tests, so take
them from the repository, at the commit closest to the installed release::

    git clone https://github.com/aleximmer/Laplace /tmp/laplace-src   # or a mirror of it
    .venv/bin/python -m integration.checks.laplace_suite --laplace-tests /tmp/laplace-src

From a bare mirror: ``git --git-dir=MIRROR archive <rev> tests | tar -x -C /tmp/laplace-src``.
The tests run against the *installed* laplace-torch, never against the checkout's package.

**How the substitution works.** Each mode is one pytest subprocess in ``PATH`` that loads this
file as a pytest plugin (``-p laplace_suite``). In modes ``mc`` and ``db`` the plugin replaces
laplace-torch's ``BaseLaplace.backend`` property (which builds the curvature backend on first
use) with one that builds ``DiagBackprop(estimator=mode)`` instead, for every posterior
DiagBackprop is meant for: diagonal over all weights or over a subnetwork (``DiagLaplace``,
``DiagSubnetLaplace``) with a GGN backend (CurvlinopsGGN, BackPackGGN, AsdlGGN, or the
default), with the test's own ``backend_kwargs``. Nothing else changes: ``_backend_cls`` keeps
the test's class, so laplace-torch's checks on it run as for that backend, and the tests'
assertions are untouched. Not substituted: the empirical Fisher backends (a different
curvature), Kronecker / full / low-rank posteriors, last-layer Laplace (DiagBackprop refuses
``last_layer=True``: the built-in backends are exact there) and the functional (GP) Laplace;
tests that use only those run as in the baseline. Direct tests of the backend classes
(``test_curv_backends_*.py``) compare exact curvature matrices of the named backends and are
left as they are. Every test that built a DiagBackprop carries the junit property
``diag_backprop``, so the report counts the tests that exercised it.

Mode ``baseline`` runs the suite without substitution; a test that fails there too fails for a
reason that has nothing to do with lsn_ext (e.g. tests newer or older than the installed
release) and is classified so.

If torchvision cannot be imported (not installed, or built for another torch), the plugin puts
a stand-in into ``sys.modules`` whose models skip the test that builds one: the suite uses
torchvision only for a large ResNet and for the feature-extractor tests, which involve no
curvature backend.

Every failure (failed or error outcome) is classified by :data:`RULES` (first match) and by
the baseline outcome; a failure no rule explains is reported as *unexplained* (not expected).
Writes ``laplace_suite.md`` (counts per mode, every failure with its cause and whether it is
expected) and ``laplace_suite.csv`` (one row per test and mode) to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
import types
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODE_ENV = "LSN_LAPLACE_SUITE_MODE"
ONLY_ENV = "LSN_LAPLACE_SUITE_ONLY"  # file of node ids: run only these
PROPERTY = "diag_backprop"
MODES = ("baseline", "mc", "db")
OUTCOMES = ("passed", "failed", "error", "skipped")


# ---------------------------------------------------------------------------------------------
# The pytest plugin (active in the subprocesses only, where MODE_ENV is set)


def _stub_torchvision() -> None:
    """A stand-in ``torchvision`` whose models skip the calling test, if the real one fails."""
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # not installed, or a build for another torch
        import pytest

        reason = f"torchvision cannot be imported here ({type(err).__name__})"

        def model(*args, **kwargs):
            pytest.skip(reason)

        def getattr_(name: str):
            if name.startswith("__"):  # module protocol (__file__, __path__, ...): absent
                raise AttributeError(name)
            return model

        models = types.ModuleType("torchvision.models")
        models.__getattr__ = getattr_
        package = types.ModuleType("torchvision")
        package.models = models
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules.update({"torchvision": package, "torchvision.models": models})


def _substitute(mode: str) -> None:
    """Patch ``BaseLaplace.backend``: mark (and in modes mc/db build) DiagBackprop's cases."""
    from laplace import baselaplace
    from laplace.curvature import GGNInterface
    from laplace.lllaplace import LLLaplace
    from laplace.subnetlaplace import DiagSubnetLaplace

    from lsn_ext import DiagBackprop

    original = baselaplace.BaseLaplace.backend

    def backend(self):
        if (
            self._backend is None
            and isinstance(self, (baselaplace.DiagLaplace, DiagSubnetLaplace))
            and not isinstance(self, LLLaplace)
            and issubclass(self._backend_cls, GGNInterface)
        ):
            if _current is not None and not any(k == PROPERTY for k, _ in _current.user_properties):
                _current.user_properties.append((PROPERTY, _current.nodeid))
            if mode != "baseline":
                likelihood = (
                    "classification" if self.likelihood == "reward_modeling" else self.likelihood
                )
                self._backend = DiagBackprop(
                    self.model,
                    likelihood,
                    dict_key_x=self.dict_key_x,
                    dict_key_y=self.dict_key_y,
                    **{**self._backend_kwargs, "estimator": mode},
                )
        return original.fget(self)

    baselaplace.BaseLaplace.backend = property(backend)


_current = None  # the running pytest item


def pytest_configure(config) -> None:
    mode = os.environ.get(MODE_ENV)
    if mode is None:
        return
    import laplace  # noqa: F401  (before the torchvision stand-in: torchmetrics probes for it)

    _stub_torchvision()
    _substitute(mode)


def pytest_collection_modifyitems(config, items) -> None:
    only = os.environ.get(ONLY_ENV)
    if only is None:
        return
    keep = set(Path(only).read_text().splitlines())
    selected = [item for item in items if item.nodeid in keep]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in keep])
    items[:] = selected


def pytest_runtest_protocol(item, nextitem) -> None:
    global _current
    _current = item


# ---------------------------------------------------------------------------------------------
# Results and their classification


@dataclass
class Case:
    """One test's outcome in one mode."""

    mode: str
    test: str  # file::name[params]
    outcome: str  # one of OUTCOMES
    message: str = ""
    diag_backprop: bool = False


@dataclass(frozen=True)
class Rule:
    """A known cause of failure: matches a test id and its failure message (regexes)."""

    cause: str
    expected: bool
    test: str = ""
    message: str = ""
    modes: tuple[str, ...] = ("mc", "db")

    def matches(self, case: Case) -> bool:
        return (
            case.mode in self.modes
            and re.search(self.test, case.test) is not None
            and re.search(self.message, case.message, flags=re.S) is not None
        )


BASELINE_CAUSE = "fails without DiagBackprop too (the tests and the installed release differ)"
UPSTREAM_CAUSE = "upstream: the tests fail with the installed packages, no lsn_ext code runs"
UNEXPLAINED = "unexplained"

RULES: tuple[Rule, ...] = (
    Rule(
        "dictionary batch for a model that takes the dictionary itself: DiagBackprop refuses it "
        "by design (the engines run the model on one input tensor; wrap the network in "
        "lsn_ext.SelectInput with dict_key_x, as the error says)",
        expected=True,
        message=r"DiagBackprop got a dictionary batch .* which takes it whole",
    ),
    Rule(
        "Monte-Carlo noise against an exact reference: the subnetwork posterior over the last "
        "layer must equal laplace-torch's exact last-layer Laplace to rtol 1e-3 (the Monte-Carlo "
        "estimate is unbiased, not exact; estimator='db' is exact for the last layer and passes)",
        expected=True,
        test=r"test_layer_subnet_masks\[.*-classification-diag\]",
        message=r"assert",
        modes=("mc",),
    ),
    Rule(
        "estimator='db' with a reward model that reshapes after its head: the exact "
        "cross-entropy first step refuses it by design (its error names ce_first_step='diag' "
        "and estimator='mc'; tests/test_reward_modeling.py)",
        expected=True,
        test=r"reward_modeling",
        message=r"exact cross-entropy first step needs the logits",
        modes=("db",),
    ),
)


def read_junit(path: Path, mode: str) -> list[Case]:
    """The cases of a pytest junit xml (``xunit1`` or ``xunit2``) for ``mode``."""
    cases = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        module = tc.get("classname", "").replace(".", "/")
        name = f"{module}.py::{tc.get('name')}" if module else tc.get("name", "")
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = tc.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or "") + "\n" + (node.text or "")
                break
        marks = [p.get("value", "") for p in tc.iter("property") if p.get("name") == PROPERTY]
        cases.append(Case(mode, marks[0] if marks else name, outcome, message.strip(), bool(marks)))
    return cases


def classify(case: Case, baseline: dict[str, str], rules=RULES) -> tuple[str, bool]:
    """``(cause, expected)`` of a failed case: the baseline's verdict, then the first rule."""
    if baseline.get(case.test) in ("failed", "error"):
        return BASELINE_CAUSE, True
    for rule in rules:
        if rule.matches(case):
            return rule.cause, rule.expected
    return UNEXPLAINED, False


def first_line(message: str, width: int = 160) -> str:
    """The first line of a failure message that says something (for the report)."""
    for line in message.splitlines():
        line = line.strip()
        if line and not line.startswith(("def ", "@")):
            return line if len(line) <= width else line[: width - 1] + "…"
    return ""


def counts(cases: list[Case]) -> dict[str, int]:
    table = dict.fromkeys(OUTCOMES, 0)
    for c in cases:
        table[c.outcome] += 1
    return table


def write_report(
    results: dict[str, list[Case]], out: Path, source: str, rules=RULES
) -> tuple[Path, Path]:
    """Write ``laplace_suite.md`` and ``laplace_suite.csv`` into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    baseline = {c.test: c.outcome for c in results.get("baseline", [])}
    rows = []
    for mode, cases in results.items():
        for c in cases:
            cause, expected = ("", "")
            if c.outcome in ("failed", "error") and mode == "baseline":
                cause, expected = UPSTREAM_CAUSE, True
            elif c.outcome in ("failed", "error"):
                cause, expected = classify(c, baseline, rules)
            rows.append((c, cause, expected))

    csv_path = out / "laplace_suite.csv"
    with csv_path.open("w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["mode", "test", "outcome", "diag_backprop", "cause", "expected", "message"])
        for c, cause, expected in rows:
            exp = "" if expected == "" else ("yes" if expected else "no")
            w.writerow(
                [c.mode, c.test, c.outcome, int(c.diag_backprop), cause, exp, first_line(c.message)]
            )

    lines = [
        "# laplace-torch's test suite with DiagBackprop substituted",
        "",
        f"Generated by `integration/checks/laplace_suite.py` ({source}). Modes: `baseline` (no "
        "substitution), `mc` and `db` (`DiagBackprop(estimator=...)` built for every diagonal "
        "posterior with a GGN backend; see the script's docstring). Per-test rows: "
        "`laplace_suite.csv`.",
        "",
        "| mode | tests run | passed | failed | error | skipped |",
        "|---|---|---|---|---|---|",
    ]
    for mode, cases in results.items():
        n = counts(cases)
        lines.append(
            f"| {mode} | {len(cases)} | {n['passed']} | {n['failed']} | {n['error']} | "
            f"{n['skipped']} |"
        )
    if "baseline" in results:
        cand = [c for c in results["baseline"] if c.diag_backprop]
        n = counts(cand)
        lines += [
            "",
            f"The baseline ran {len(results['baseline'])} tests; {len(cand)} of them build a "
            "diagonal posterior with a GGN backend, the tests the `mc` and `db` modes rerun with "
            f"DiagBackprop (baseline outcomes of these: {n['passed']} passed, {n['failed']} "
            f"failed, {n['error']} errors, {n['skipped']} skipped). The other tests do not reach "
            "the substituted code, so their outcome is the baseline's.",
        ]
    failing = [r for r in rows if r[0].outcome in ("failed", "error")]
    lines += ["", "## Failures", ""]
    if not failing:
        lines.append("None.")
    else:
        by_cause: dict[str, list] = {}
        for r in failing:
            by_cause.setdefault(r[1], []).append(r)
        lines += ["| cause | expected | modes | tests |", "|---|---|---|---|"]
        for cause, rs in by_cause.items():
            modes = ", ".join(sorted({r[0].mode for r in rs}, key=MODES.index))
            lines.append(f"| {cause} | {'yes' if rs[0][2] else 'no'} | {modes} | {len(rs)} |")
        lines += ["", "| mode | test | cause | expected | message |", "|---|---|---|---|---|"]
        for c, cause, expected in failing:
            msg = first_line(c.message, 120).replace("|", "\\|")
            lines.append(
                f"| {c.mode} | `{c.test}` | {cause} | {'yes' if expected else 'no'} | {msg} |"
            )
    md_path = out / "laplace_suite.md"
    md_path.write_text("\n".join(lines) + "\n")
    return md_path, csv_path


# ---------------------------------------------------------------------------------------------
# Running the suite


def run_mode(
    tests_root: Path, mode: str, xml: Path, files: list[str], keyword: str | None, only: Path
) -> int:
    """Run laplace-torch's tests in ``tests_root`` under ``mode``; pytest's exit code.

    The baseline runs ``files``; the estimators run the tests listed in ``only``.
    """
    env = dict(os.environ)
    env[MODE_ENV] = mode
    if mode != "baseline":
        env[ONLY_ENV] = str(only)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        ini = Path(tmp) / "pytest.ini"
        ini.write_text("[pytest]\n")  # keep this project's pytest configuration out
        cmd = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "laplace_suite",
            "-c", str(ini), "--rootdir", str(tests_root), f"--junitxml={xml}",
            "-o", "junit_family=xunit1", "-W", "ignore", *files,
        ]  # fmt: skip
        if keyword:
            cmd += ["-k", keyword]
        res = subprocess.run(cmd, cwd=tests_root, env=env, capture_output=True, text=True)
    tail = res.stdout.strip().splitlines()[-1:] or [res.stderr.strip()[-500:]]
    print(f"[{mode}] {tail[0]}", flush=True)
    return res.returncode


def _source(tests_root: Path) -> str:
    from importlib import metadata

    import torch

    rev = subprocess.run(
        ["git", "-C", str(tests_root), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    )
    where = f"tests at commit {rev.stdout.strip()}" if rev.returncode == 0 else "tests"
    return (
        f"{where}, laplace-torch {metadata.version('laplace-torch')} installed, "
        f"torch {torch.__version__}, Python {sys.version.split()[0]}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--laplace-tests",
        type=Path,
        required=True,
        help="laplace-torch checkout: the folder holding tests/ (see the module docstring)",
    )
    parser.add_argument(
        "--estimators", nargs="+", choices=MODES[1:], default=list(MODES[1:]), help="DiagBackprop"
    )
    parser.add_argument(
        "--files", nargs="+", default=["tests"], help="test files or folders, relative to PATH"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--source", help="what the tests are, for the report (default: git)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression (a partial run)")
    args = parser.parse_args(argv)
    root = args.laplace_tests.resolve()
    if root.name == "tests" and not (root / "tests").is_dir():
        root = root.parent
    if not (root / "tests" / "utils.py").is_file():
        parser.error(
            f"{args.laplace_tests} holds no laplace-torch tests/utils.py: pass the folder that "
            "holds laplace-torch's tests/ (a clone of its repository, see --help)"
        )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        only = Path(tmp) / "substituted.txt"
        for mode in ("baseline", *args.estimators):
            xml = Path(tmp) / f"{mode}.xml"
            code = run_mode(root, mode, xml, args.files, args.keyword, only)
            if not xml.is_file():
                print(f"[{mode}] pytest wrote no report (exit code {code})", file=sys.stderr)
                return 1
            results[mode] = read_junit(xml, mode)
            if mode == "baseline":
                only.write_text("\n".join(c.test for c in results[mode] if c.diag_backprop))
    source = f"{args.source or _source(root)}; files: {' '.join(args.files)}"
    md, csv_path = write_report(results, args.out, source)
    print(f"wrote {md} and {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
