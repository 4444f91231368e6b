"""The facts a rule carries about its module type: functional forms and per-sample kernels."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lsn_ext.rules import RULES, Functional, TanhRule, functional_forms

# The functional activations the native engine has always run as rule nodes, with the module
# that each computes like: the table the rules replace (was lsn_ext.engine ACTIVATIONS).
ACTIVATIONS = {
    "celu": nn.CELU,
    "elu": nn.ELU,
    "gelu": nn.GELU,
    "hardsigmoid": nn.Hardsigmoid,
    "hardswish": nn.Hardswish,
    "leaky_relu": nn.LeakyReLU,
    "mish": nn.Mish,
    "selu": nn.SELU,
    "sigmoid": nn.Sigmoid,
    "silu": nn.SiLU,
    "softplus": nn.Softplus,
    "tanh": nn.Tanh,
}

# Other values than the defaults, per argument name (the in-place flag stays off: the check
# compares two calls on the same input).
OTHER = {"negative_slope": 0.2, "alpha": 0.7, "approximate": "tanh", "beta": 2.0, "threshold": 1.5}


def test_the_default_rules_carry_the_functional_activations():
    forms = functional_forms()
    assert {name: form.module for name, (form, _) in forms.items()} == ACTIVATIONS
    for name, (form, rule) in forms.items():
        assert form.name == name
        assert RULES[form.module] is rule, name


KEYWORD_ONLY = {"gelu"}  # F.gelu(input, *, approximate="none")


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("values", ["defaults", "others"])
def test_each_functional_form_computes_what_its_module_computes(name, values):
    form, _ = functional_forms()[name]
    kwargs = {k: OTHER.get(k, d) if values == "others" else d for k, d in form.arguments}
    x = torch.linspace(-5, 5, 41)
    want = form.module(**kwargs)(x)
    got = getattr(F, name)(x, **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if name not in KEYWORD_ONLY:  # the arguments' order is the function's
        positional = getattr(F, name)(x, *kwargs.values())
        torch.testing.assert_close(positional, want, rtol=0, atol=0)


class _MyTanh(nn.Tanh):
    pass


class _MyTanhRule(TanhRule):
    functional = (Functional("tanh", _MyTanh),)


def test_a_form_counts_only_where_its_module_class_has_the_rule_that_carries_it(monkeypatch):
    # TanhRule's form builds nn.Tanh: registering the rule for a subclass adds no form.
    monkeypatch.setitem(RULES, _MyTanh, TanhRule())
    assert functional_forms()["tanh"][0].module is nn.Tanh
    # Unregistering nn.Tanh takes F.tanh's form away with it.
    monkeypatch.delitem(RULES, nn.Tanh)
    assert "tanh" not in functional_forms()


def test_two_module_classes_claiming_one_function_are_refused(monkeypatch):
    monkeypatch.setitem(RULES, _MyTanh, _MyTanhRule())
    with pytest.raises(ValueError, match=r"'tanh' is claimed by the rules of torch.nn.Tanh and"):
        functional_forms()


# The classes whose per-sample gradients the Monte-Carlo estimator has always taken from a
# direct kernel (was lsn_ext.estimators _CONV_DIMS, _CONV_T_DIMS, _NORMS and nn.Linear).
KERNELS = {
    nn.Linear: "linear",
    **dict.fromkeys(
        (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
         nn.ConvTranspose3d),
        "convolution",
    ),
    **dict.fromkeys(
        (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d, nn.InstanceNorm2d,
         nn.InstanceNorm3d, nn.GroupNorm, nn.LayerNorm),
        "norm",
    ),
}  # fmt: skip


def test_the_torch_classes_with_a_per_sample_kernel_are_the_old_tables():
    torch_classes = {c: r for c, r in RULES.items() if c.__module__.startswith("torch.nn.")}
    got = {c: r.per_sample_kernel for c, r in torch_classes.items() if r.per_sample_kernel}
    assert got == KERNELS
