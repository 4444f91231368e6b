import itertools

import pytest
import torch
from torch import nn

from lsn_ext.rules import AvgPoolRule, StructuralRule
from tests.reference import assert_rule_matches, squared_input_rule

# Spatial sizes chosen so that ceil_mode adds a window for kernel 3 and stride 2.
SHAPES = {1: (2, 3, 6), 2: (2, 2, 6, 5), 3: (1, 2, 4, 6, 3)}
AVG = {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}
MAX = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}


def _avg_cases():
    cases = {}
    for dim, stride, pad, ceil, cip, div in itertools.product(
        (1, 2, 3), (1, 2), (0, 1), (False, True), (False, True), (None, 2)
    ):
        if dim == 1 and div is not None:  # AvgPool1d has no divisor_override
            continue
        kwargs = {"stride": stride, "padding": pad, "ceil_mode": ceil, "count_include_pad": cip}
        if div is not None:
            kwargs["divisor_override"] = div
        name = f"{dim}d-k3-s{stride}-p{pad}" + "-ceil" * ceil + "-cip" * cip
        name += f"-div{div}" if div is not None else ""
        cases[name] = (AVG[dim](3, **kwargs), SHAPES[dim])
    cases["1d-k2-default-stride"] = (nn.AvgPool1d(2), SHAPES[1])
    cases["2d-k2-default-stride"] = (nn.AvgPool2d(2), SHAPES[2])
    cases["2d-tuple-k2x3-s1x2-p1-ceil"] = (
        nn.AvgPool2d((2, 3), (1, 2), 1, ceil_mode=True, count_include_pad=False),
        SHAPES[2],
    )
    cases["3d-k2-s1-p1-div7"] = (nn.AvgPool3d(2, 1, 1, divisor_override=7), SHAPES[3])
    cases["2d-unbatched-ceil"] = (nn.AvgPool2d(3, 2, 1, ceil_mode=True), SHAPES[2][1:])
    cases["1d-unbatched-no-cip"] = (nn.AvgPool1d(3, 2, 1, count_include_pad=False), (3, 6))
    return cases


AVG_CASES = _avg_cases()


@pytest.mark.parametrize("case", AVG_CASES.values(), ids=AVG_CASES.keys())
def test_avgpool_rule_matches_jacrev(case):
    module, shape = case
    assert_rule_matches(AvgPoolRule(), module, torch.randn(shape))


def test_avgpool_rule_by_hand():
    # Windows [x0, x1] and, with ceil_mode, [x2] alone: divisors 2 and 1.
    pool = nn.AvgPool1d(2, 2, ceil_mode=True, count_include_pad=False)
    x = torch.randn(1, 1, 3)
    m_out = torch.tensor([[[8.0, 3.0]]])
    m_in = AvgPoolRule().input_rule(pool, x, pool(x), m_out)
    torch.testing.assert_close(m_in, torch.tensor([[[2.0, 2.0, 3.0]]]))


def test_avgpool_rule_is_m_over_k4_for_plain_kxk():
    """The SPEC's formula: each input of a k×k window gets ``m / k⁴``."""
    pool = nn.AvgPool2d(2)
    x = torch.randn(2, 3, 4, 6)
    m_out = torch.rand(2, 3, 2, 3)
    m_in = AvgPoolRule().input_rule(pool, x, pool(x), m_out)
    expected = m_out.repeat_interleave(2, 2).repeat_interleave(2, 3) / 16
    torch.testing.assert_close(m_in, expected)


def test_avgpool_rule_float32_matches_float64():
    pool = nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False)
    x, m_out = torch.randn(2, 2, 6, 5), torch.rand(2, 2, 4, 3)
    m64 = AvgPoolRule().input_rule(pool, x, pool(x), m_out)
    x32, m32 = x.float(), m_out.float()
    m_in = AvgPoolRule().input_rule(pool, x32, pool(x32), m32)
    assert m_in.dtype == torch.float32
    torch.testing.assert_close(m_in.double(), m64, rtol=1e-5, atol=1e-7)


def test_avgpool_rule_refuses_other_modules():
    x = torch.randn(1, 1, 4)
    with pytest.raises(TypeError, match="AvgPool1d/2d/3d"):
        AvgPoolRule().input_rule(nn.MaxPool1d(2), x, x[..., :2], x[..., :2])


def _max_cases():
    cases = {}
    windows = {"k3s1": (3, 1), "k3s2": (3, 2), "k2s2": (2, 2)}
    for dim, (wname, (k, s)), pad, dil, ceil in itertools.product(
        (1, 2, 3), windows.items(), (0, 1), (1, 2), (False, True)
    ):
        if dil == 2 and k == 2:
            continue
        name = f"{dim}d-{wname}-p{pad}-d{dil}" + "-ceil" * ceil
        module = MAX[dim](k, s, pad, dilation=dil, ceil_mode=ceil)
        cases[name] = (module, SHAPES[dim] if dim < 3 else (1, 2, 5, 6, 5))
    return cases


MAX_CASES = _max_cases()


@pytest.mark.parametrize("case", MAX_CASES.values(), ids=MAX_CASES.keys())
def test_maxpool_structural_rule_matches_jacrev(case):
    module, shape = case
    assert_rule_matches(StructuralRule(), module, torch.randn(shape))


@pytest.mark.parametrize("dim", [1, 2, 3], ids=["1d", "2d", "3d"])
def test_maxpool_return_indices(dim):
    pool = MAX[dim](3, 2, 1, return_indices=True)
    x = torch.randn(SHAPES[dim])
    y, _ = pool(x)
    m_out = torch.rand_like(y)
    m_in = StructuralRule().input_rule(pool, x, y, m_out)
    expected = squared_input_rule(lambda t: pool(t)[0], x, m_out)
    torch.testing.assert_close(m_in, expected, rtol=1e-10, atol=1e-12)
    # Overlapping windows: some input is the maximum of two windows and gets both m's.
    assert m_in.max() > m_out.max()
