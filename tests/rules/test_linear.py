import pytest
import torch
from torch import nn

from lsn_ext.rules import LinearRule
from tests.reference import assert_rule_matches, block_input_rule

CASES = {
    "2d": ((5, 3, True), (4, 5)),
    "no-bias": ((5, 3, False), (4, 5)),
    "4d-leading": ((4, 2, True), (2, 3, 2, 4)),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_linear_rule_matches_jacrev(case):
    (n_in, n_out, bias), shape = case
    assert_rule_matches(LinearRule(), nn.Linear(n_in, n_out, bias=bias), torch.randn(shape))


def test_linear_block_rule_matches_dense():
    module = nn.Linear(5, 3)
    x = torch.randn(4, 5)
    y = module(x).detach()
    p = torch.softmax(torch.randn(4, 3), 1)
    h = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    m_in = LinearRule().input_rule_block(module, x, y, h)
    torch.testing.assert_close(m_in, block_input_rule(module, x, h), rtol=1e-10, atol=1e-12)


def test_linear_block_rule_refuses_spatial_output():
    module = nn.Linear(4, 2)
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="2-D logits"):
        LinearRule().input_rule_block(module, x, module(x), torch.zeros(2, 2, 2, 3))
