"""integration/checks/laplace_suite.py's junit reader, failure classifier and report, offline.

The script itself runs laplace-torch's upstream tests (not shipped, not downloaded here); these
tests feed it a synthetic junit file instead.
"""

import csv

from integration.checks import laplace_suite as suite


def _testcase(module: str, name: str, marked: bool, child: str = "") -> str:
    nodeid = f"tests/{module}.py::{name}"
    mark = f'<property name="diag_backprop" value="{nodeid}"/>' if marked else ""
    return (
        f'<testcase classname="tests.{module}" name="{name}">'
        f"<properties>{mark}</properties>{child}</testcase>"
    )


DICT_ERROR = (
    "ValueError: DiagBackprop got a dictionary batch (keys [&apos;a&apos;]) for a CustomModel, "
    "which takes it whole"
)
JUNIT = (
    '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="5">'
    + _testcase("test_baselaplace", "test_fit[DiagLaplace]", True)
    + _testcase(
        "test_baselaplace",
        "test_dict_data[clf-DiagLaplace]",
        True,
        f'<failure message="{DICT_ERROR}">trace</failure>',
    )
    + _testcase(
        "test_baselaplace",
        "test_old[DiagLaplace]",
        True,
        '<error message="AttributeError: no such thing">trace</error>',
    )
    + _testcase(
        "test_baselaplace",
        "test_close[DiagLaplace]",
        True,
        '<failure message="AssertionError: Tensor-likes are not close!">trace</failure>',
    )
    + _testcase("test_utils", "test_skipped", False, '<skipped message="no torchvision"/>')
    + "</testsuite></testsuites>"
)


def _results(tmp_path):
    path = tmp_path / "mc.xml"
    path.write_text(JUNIT)
    mc = suite.read_junit(path, "mc")
    baseline = [
        suite.Case(
            "baseline", c.test, "error" if "test_old" in c.test else "passed", "", c.diag_backprop
        )
        for c in mc
    ]
    return {"baseline": baseline, "mc": mc}


def test_read_junit_outcomes_and_substitution_marks(tmp_path):
    cases = _results(tmp_path)["mc"]
    assert [c.outcome for c in cases] == ["passed", "failed", "error", "failed", "skipped"]
    assert cases[0].test == "tests/test_baselaplace.py::test_fit[DiagLaplace]"
    assert [c.diag_backprop for c in cases] == [True, True, True, True, False]
    assert cases[4].test == "tests/test_utils.py::test_skipped"
    assert "dictionary batch" in cases[1].message


def test_classify_by_baseline_then_rules_else_unexplained(tmp_path):
    results = _results(tmp_path)
    baseline = {c.test: c.outcome for c in results["baseline"]}
    dict_case, old_case, close_case = results["mc"][1:4]
    cause, expected = suite.classify(dict_case, baseline)
    assert expected
    assert "SelectInput" in cause
    assert suite.classify(old_case, baseline) == (suite.BASELINE_CAUSE, True)
    assert suite.classify(close_case, baseline) == (suite.UNEXPLAINED, False)


def test_a_rule_matches_its_modes_only():
    rule = suite.Rule("why", True, test=r"reward", message=r"first step", modes=("db",))
    hit = suite.Case("db", "t::test_reward_modeling", "failed", "the first step needs")
    assert rule.matches(hit)
    assert not rule.matches(suite.Case("mc", hit.test, "failed", hit.message))
    assert not rule.matches(suite.Case("db", "t::test_other", "failed", hit.message))


def test_report_counts_and_lists_every_failure(tmp_path):
    md, csv_path = suite.write_report(_results(tmp_path), tmp_path / "out", "synthetic")
    text = md.read_text()
    assert "| mc | 5 | 1 | 2 | 1 | 1 |" in text
    assert "| baseline | 5 | 4 | 0 | 1 | 0 |" in text
    assert "4 of them build a diagonal posterior" in text
    assert "`tests/test_baselaplace.py::test_close[DiagLaplace]` | unexplained | no |" in text
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 10
    failed = [r for r in rows if r["mode"] == "mc" and r["outcome"] in ("failed", "error")]
    assert [r["expected"] for r in failed] == ["yes", "yes", "no"]
