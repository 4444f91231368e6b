import pytest
import torch
from torch import nn

from lsn_ext.rules import BatchNormRule
from tests.reference import assert_rule_matches

CASES = {
    "bn1d-2d-input": (lambda: nn.BatchNorm1d(3), (4, 3)),
    "bn1d-3d-input": (lambda: nn.BatchNorm1d(3), (2, 3, 5)),
    "bn2d": (lambda: nn.BatchNorm2d(3), (2, 3, 4, 4)),
    "bn3d": (lambda: nn.BatchNorm3d(2), (2, 2, 3, 3, 3)),
    "bn2d-no-affine": (lambda: nn.BatchNorm2d(3, affine=False), (2, 3, 4, 4)),
}


def randomise(bn):
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.3, 3)
    if bn.affine:
        bn.weight.data.uniform_(-2, 2)
        bn.bias.data.uniform_(-1, 1)
    return bn.eval()


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_batchnorm_eval_matches_jacrev(case):
    make, shape = case
    assert_rule_matches(BatchNormRule(), randomise(make()), torch.randn(shape))


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.BatchNorm2d(3).train(),
        lambda: nn.BatchNorm2d(3, track_running_stats=False).eval(),
    ],
    ids=["training-mode", "no-running-stats"],
)
def test_batch_statistics_are_refused(make):
    module = make()
    with pytest.raises(ValueError, match=r"BatchNorm2d\(3\) normalises with batch statistics"):
        BatchNormRule().input_rule(module, torch.randn(2, 3, 2, 2), None, torch.ones(2, 3, 2, 2))
