import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lsn_ext.rules import UpsampleRule
from lsn_ext.rules.upsample import interpolate_rule, interpolation_matrix
from tests.reference import assert_rule_matches, squared_input_rule

# jacrev of nearest-exact warns that vmap has no batching rule for its backward.
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")

SHAPES = {1: (2, 3, 5), 2: (2, 3, 4, 5), 3: (1, 2, 3, 4, 3)}
MODES = {
    "nearest": (1, 2, 3),
    "nearest-exact": (1, 2, 3),
    "area": (1, 2, 3),
    "linear": (1,),
    "bilinear": (2,),
    "bicubic": (2,),
    "trilinear": (3,),
}
# (id, kwargs): integer, fractional and down-scaling factors, per-axis factors, explicit sizes.
SPECS = [
    ("scale2", {"scale_factor": 2}),
    ("scale1.5", {"scale_factor": 1.5}),
    ("scale1.5-recompute", {"scale_factor": 1.5, "recompute_scale_factor": True}),
    ("scale0.5", {"scale_factor": 0.5}),
    ("scale0.7-recompute", {"scale_factor": 0.7, "recompute_scale_factor": True}),
    ("scale-per-axis", {"scale_factor": (1.5, 2.0, 0.7)}),
    ("size7", {"size": 7}),
    ("size-per-axis", {"size": (3, 7, 2)}),
]


def _module_cases():
    cases = {}
    for mode, dims in MODES.items():
        interpolating = mode not in ("nearest", "nearest-exact", "area")
        for dim in dims:
            for ac in (False, True) if interpolating else (None,):
                for spec_id, spec in SPECS:
                    kwargs = dict(spec)
                    if isinstance(next(iter(kwargs.values())), tuple):
                        kwargs = {k: v[:dim] for k, v in kwargs.items()}
                    name = f"{mode}-{dim}d" + ("-ac" if ac else "") + f"-{spec_id}"
                    module = nn.Upsample(mode=mode, align_corners=ac, **kwargs)
                    cases[name] = (module, SHAPES[dim])
    # The output has the input's size, but the coordinates use the scale 1.4, not 1.
    for ac in (False, True):
        cases["bilinear-same-size-scale1.4" + "-ac" * ac] = (
            nn.Upsample(scale_factor=1.4, mode="bilinear", align_corners=ac),
            (1, 2, 2, 3),
        )
    cases["bicubic-width1-scale2"] = (nn.Upsample(scale_factor=2, mode="bicubic"), (2, 3, 4, 1))
    cases["nearest2d-scale2"] = (nn.UpsamplingNearest2d(scale_factor=2), SHAPES[2])
    cases["nearest2d-size"] = (nn.UpsamplingNearest2d(size=(3, 7)), SHAPES[2])
    cases["bilinear2d-scale2"] = (nn.UpsamplingBilinear2d(scale_factor=2), SHAPES[2])
    cases["bilinear2d-scale1.5"] = (nn.UpsamplingBilinear2d(scale_factor=1.5), SHAPES[2])
    cases["bilinear2d-size"] = (nn.UpsamplingBilinear2d(size=(3, 7)), SHAPES[2])
    return cases


MODULE_CASES = _module_cases()


@pytest.mark.parametrize("case", MODULE_CASES.values(), ids=MODULE_CASES.keys())
def test_upsample_rule_matches_jacrev(case):
    module, shape = case
    assert_rule_matches(UpsampleRule(), module, torch.randn(shape))


FUNCTIONAL_CASES = {
    "bilinear-antialias-scale0.5": {"mode": "bilinear", "antialias": True, "scale_factor": 0.5},
    "bilinear-antialias-ac-size": {
        "mode": "bilinear",
        "antialias": True,
        "align_corners": True,
        "size": (2, 3),
    },
    "bicubic-antialias-scale0.4": {"mode": "bicubic", "antialias": True, "scale_factor": 0.4},
    "bicubic-antialias-mixed": {
        "mode": "bicubic",
        "antialias": True,
        "scale_factor": (0.6, 1.7),
        "recompute_scale_factor": True,
    },
    "bicubic-ac-scale1.5": {"mode": "bicubic", "align_corners": True, "scale_factor": 1.5},
    "nearest-exact-size": {"mode": "nearest-exact", "size": (3, 8)},
    "area-scale0.5": {"mode": "area", "scale_factor": 0.5},
    # PyTorch's antialias forward is wrong for an output width of 1 (its backward, which jacrev
    # uses, is right); the rule must not inherit the bug through the interpolation matrices.
    "bilinear-antialias-to-width1": {"mode": "bilinear", "antialias": True, "size": (3, 1)},
    "bicubic-antialias-to-width1": {"mode": "bicubic", "antialias": True, "size": (6, 1)},
}


@pytest.mark.parametrize("kwargs", FUNCTIONAL_CASES.values(), ids=FUNCTIONAL_CASES.keys())
def test_interpolate_rule_matches_jacrev(kwargs):
    x = torch.randn(2, 3, 5, 7)

    def f(t):
        return F.interpolate(t, **kwargs)

    y = f(x)
    m_out = torch.rand_like(y)
    m_in = interpolate_rule(x, y, m_out, **kwargs)
    torch.testing.assert_close(m_in, squared_input_rule(f, x, m_out), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_interpolate_rule_antialias_width1_input(mode):
    x = torch.randn(2, 3, 5, 1)

    def f(t):
        return F.interpolate(t, size=(6, 1), mode=mode, antialias=True)

    y = f(x)
    m_out = torch.rand_like(y)
    m_in = interpolate_rule(x, y, m_out, size=(6, 1), mode=mode, antialias=True)
    torch.testing.assert_close(m_in, squared_input_rule(f, x, m_out), rtol=1e-10, atol=1e-12)


def test_upsample_rule_is_interpolate_rule():
    module = nn.Upsample(scale_factor=1.5, mode="bicubic", align_corners=True)
    x = torch.randn(2, 3, 4, 5)
    y = module(x)
    m_out = torch.rand_like(y)
    expected = interpolate_rule(x, y, m_out, scale_factor=1.5, mode="bicubic", align_corners=True)
    torch.testing.assert_close(UpsampleRule().input_rule(module, x, y, m_out), expected)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic", "nearest"])
def test_upsample_rule_keeps_channels_apart(mode):
    module = nn.Upsample(scale_factor=2, mode=mode)
    x = torch.randn(2, 3, 4, 4)
    m_out = torch.zeros(2, 3, 8, 8)
    m_out[:, 1] = torch.rand(2, 8, 8)
    m_in = UpsampleRule().input_rule(module, x, module(x), m_out)
    assert (m_in[:, 1] > 0).all()
    assert (m_in[:, [0, 2]] == 0).all()


def test_interpolation_matrix_is_pytorchs_linear_weights():
    # align_corners=True, 3 → 5: sources at 0, 0.5, 1, 1.5, 2.
    A = interpolation_matrix(torch.zeros(1, 1, 3), 0, size=5, mode="linear", align_corners=True)
    expected = torch.tensor(
        [[1, 0, 0], [0.5, 0.5, 0], [0, 1, 0], [0, 0.5, 0.5], [0, 0, 1]], dtype=torch.float64
    )
    torch.testing.assert_close(A, expected)


@pytest.mark.parametrize(
    ("mode", "shape"),
    [
        ("bilinear", (2, 3, 4, 5)),
        ("bicubic", (2, 3, 4, 5)),
        ("trilinear", (1, 2, 3, 4, 3)),
        ("nearest", (2, 3, 4, 5)),
    ],
    ids=["bilinear", "bicubic", "trilinear", "nearest"],
)
def test_upsample_rule_float32_matches_float64(mode, shape):
    module = nn.Upsample(scale_factor=1.5, mode=mode)
    x = torch.randn(shape)
    y = module(x)
    m_out = torch.rand_like(y)
    m64 = UpsampleRule().input_rule(module, x, y, m_out)
    x32, m32 = x.float(), m_out.float()
    m_in = UpsampleRule().input_rule(module, x32, module(x32), m32)
    assert m_in.dtype == torch.float32
    torch.testing.assert_close(m_in.double(), m64, rtol=1e-5, atol=1e-6)


def test_interpolate_rule_rejects_mismatched_shapes():
    x = torch.randn(1, 2, 4)
    y = F.interpolate(x, scale_factor=2, mode="linear")
    with pytest.raises(ValueError, match="m_out has shape"):
        interpolate_rule(x, y, torch.ones(1, 2, 7), scale_factor=2, mode="linear")
    with pytest.raises(ValueError, match="output has 8"):
        interpolate_rule(x, y, torch.ones_like(y), scale_factor=3, mode="linear")
