"""Monte-Carlo calls after the verified first one against a fresh model (issue 38).

``ggn_diagonal(..., estimator="mc")`` verifies its first call per model and input signature
(per-sample gradients checked against batch gradients) and lets later calls take a faster
backward pass that relies on what the verified call found. Whatever changes between two calls
(hooks, modes, swapped modules, data-dependent branches, batch sizes, parametrizations), the
second call on the changed model must give what a fresh ``copy.deepcopy`` of the changed model
gives on its first call, with the same Rademacher draws: the same diagonals bit for bit (the
two run the same code on the same numbers), or the same error. The deep copy is a fresh model
for every cache keyed by model identity. Where it matters, the exact float64 GGN diagonal
checks both by a z-test over 200 draws.

Before the fix of issue 38 the fast path returned a stale plan's numbers (or no error) after a
hook, a mode switch, a swapped module, a data-dependent branch or a direct ``forward`` call: 55
of these tests failed there. The others (pre-hooks, parametrizations, tied, frozen or replaced
parameters, batch-size changes, ``no_grad`` regions) passed and guard the new code.
"""

from __future__ import annotations

import copy
import math
import random
import types
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.data import DataLoader, TensorDataset

import lsn_ext
from lsn_ext.exact import exact_ggn_diagonal
from tests.estimators.test_estimators import _randomised


@pytest.fixture(autouse=True)
def _one_thread_no_kernel_timing():
    """One thread, and deterministic algorithms (the grouped convolution kernel, no timing).

    The tensors here are tiny: on a loaded 2-core machine two threads spin-waiting on each
    other made one such convolution's backward ~1000x slower (0.1 s against 70 µs). The kernel
    choice by timing would be the same for both calls of a comparison (cached per signature);
    deterministic algorithms skip the timing of the many new signatures these tests make.
    """
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(deterministic)
    torch.set_num_threads(threads)


def _mc(model, x, y, seed, samples=2, loss="bce"):
    gen = torch.Generator().manual_seed(seed)
    return lsn_ext.ggn_diagonal(
        model, x, y, loss, estimator="mc", mc_samples=samples, generator=gen
    )


def _outcome(model, x, y, seed, loss="bce"):
    """The Monte-Carlo result, or the exception it raised."""
    try:
        return _mc(model, x, y, seed, loss=loss)
    except Exception as err:  # compared with the fresh copy's
        return err


def _ratios(got, want) -> str:
    """Per parameter, the second call's diagonal sum over the fresh copy's."""
    parts = []
    for name, d in want.diagonals.items():
        if not torch.equal(got.diagonals[name], d):
            total = float(d.sum())
            ratio = float(got.diagonals[name].sum()) / total if total else math.inf
            parts.append(f"{name}: {ratio:.4g}x")
    return "second call / fresh copy: " + ", ".join(parts)


def _show(outcome) -> str:
    if isinstance(outcome, Exception):
        return f"{type(outcome).__name__}: {outcome}"
    return "diagonals (no error)"


def _assert_matches_fresh(model, x, y, seed=0, loss="bce", numbers=True):
    """The next call on ``model`` equals a fresh deep copy's first call (same draws).

    With ``numbers``, the fresh copy must return diagonals (some non-zero); else it may raise,
    and then the call on ``model`` must raise the same type with the same message.
    """
    want = _outcome(copy.deepcopy(model), x, y, seed, loss)
    got = _outcome(model, x, y, seed, loss)
    if isinstance(want, Exception):
        assert not numbers, f"the fresh copy raised {_show(want)}"
        assert type(got) is type(want), f"fresh copy: {_show(want)}; second call: {_show(got)}"
        assert str(got) == str(want)
        return want
    assert not isinstance(got, Exception), f"fresh copy: numbers; second call: {_show(got)}"
    assert sum(float(d.sum()) for d in want.diagonals.values()) > 0
    assert got.diagonals.keys() == want.diagonals.keys()
    same = all(torch.equal(got.diagonals[n], d) for n, d in want.diagonals.items())
    assert same, _ratios(got, want)
    assert got.mc_paths == want.mc_paths
    return want


def _batch(n=3, sign=-1.0, size=5, channels=2):
    """Inputs whose mean has the given sign, and binary targets for one output channel."""
    x = torch.randn(n, channels, size, size) + sign
    return x, (torch.rand(n, 1, size, size) > 0.5).double()


# -- the reproducers ---------------------------------------------------------------------------


class _Net(nn.Module):
    """conv1 (the entry module) → act → conv2 → act → head; two channels throughout.

    With ``branch``, inputs with a positive mean add ``conv2`` (``"again"``) or a convolution
    called nowhere else (``"side"``) on the flipped input to the hidden state, after the main
    call of ``conv2``.
    """

    def __init__(self, branch: str | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 2, 3, padding=1)
        self.act = nn.Tanh()
        self.conv2 = nn.Conv2d(2, 2, 3, padding=1)
        self.head = nn.Conv2d(2, 1, 1)
        self.branch = branch
        if branch == "side":
            self.side = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        h = self.conv2(self.act(self.conv1(x)))
        if self.branch and x.mean() > 0:
            h = h + (self.side if self.branch == "side" else self.conv2)(x.flip(-1))
        return self.head(self.act(h))


def _global_hook(model):
    model.conv2.scaled_by_test_hook = True
    return nn.modules.module.register_module_forward_hook(
        lambda m, args, out: 2 * out if getattr(m, "scaled_by_test_hook", False) else None
    )


HOOKS: dict[str, Callable] = {  # change → its handle
    "conv2-hook-2o": lambda m: m.conv2.register_forward_hook(lambda _, a, o: 2 * o),
    "conv2-hook-0.5o+1": lambda m: m.conv2.register_forward_hook(lambda _, a, o: 0.5 * o + 1),
    "entry-conv1-hook-2o": lambda m: m.conv1.register_forward_hook(lambda _, a, o: 2 * o),
    "conv2-in-place-hook-mul_": lambda m: m.conv2.register_forward_hook(lambda _, a, o: o.mul_(2)),
    "global-module-hook-2o-on-conv2": _global_hook,
    "conv2-pre-hook-2x": lambda m: m.conv2.register_forward_pre_hook(lambda _, a: (2 * a[0],)),
}


@pytest.mark.parametrize("change", HOOKS)
def test_a_hook_registered_after_the_first_call_is_followed(change):
    model = _Net()
    x, y = _batch()
    _mc(model, x, y, 1)  # verified
    handle = HOOKS[change](model)
    try:
        _assert_matches_fresh(model, x, y)
    finally:
        handle.remove()


def test_a_hook_removed_after_the_first_call_is_followed():
    model = _Net()
    x, y = _batch()
    handle = model.conv2.register_forward_hook(lambda _, a, o: 2 * o)
    _mc(model, x, y, 1)  # verified with the hook
    handle.remove()
    _assert_matches_fresh(model, x, y)


@pytest.mark.parametrize(
    "branch",
    ["side", "again"],
    ids=["module-only-in-branch", "module-called-again-in-branch"],
)
def test_a_data_dependent_branch_taken_only_on_the_second_batch(branch):
    model = _Net(branch)
    x1, y1 = _batch(sign=-1.0)
    x2, y2 = _batch(sign=1.0)  # same shapes: the same signature
    _mc(model, x1, y1, 1)  # verified without the branch
    _assert_matches_fresh(model, x2, y2)


def test_a_laplace_fit_over_batches_that_take_different_branches():
    model = _Net("side")
    (x1, y1), (x2, y2) = _batch(sign=-1.0), _batch(sign=1.0)
    loader = DataLoader(TensorDataset(torch.cat([x1, x2]), torch.cat([y1, y2])), batch_size=3)
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=lsn_ext.DiagBackprop,
        backend_kwargs={"loss": "bce", "estimator": "mc", "mc_samples": 1, "seed": 0},
    )
    la.fit(loader)
    want = sum(
        lsn_ext.ggn_diagonal(
            copy.deepcopy(model), xb, yb, "bce", estimator="mc",
            generator=la.backend._batch_generator(xb, yb),
        ).vector
        for xb, yb in loader
    )  # fmt: skip
    start, off = 0, []
    for name, p in model.named_parameters():
        part = slice(start, start + p.numel())
        start += p.numel()
        if not torch.equal(la.H[part], want[part]):
            off.append(f"{name}: {float(la.H[part].sum() / want[part].sum()):.4g}x")
    side = sum(p.numel() for p in model.side.parameters())
    assert float(want[-side:].sum()) > 0  # the side convolution has curvature on batch 2
    assert not off, "la.H / fresh copies per batch: " + ", ".join(off)


class _CentreInTraining(nn.Module):
    """Subtracts the batch mean in training mode (mixes the samples), the identity in eval."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True) if self.training else x


class _MixingTanh(nn.Tanh):
    def forward(self, x):
        return super().forward(x - x.mean(0, keepdim=True))


class _MixingReLU(nn.ReLU):
    def forward(self, x):
        return super().forward(x - x.mean(0, keepdim=True))


class _MixOutput:
    """Mixin: the module's output minus its batch mean."""

    def forward(self, x):
        out = super().forward(x)
        return out - out.mean(0, keepdim=True)


class _MixingConv1d(_MixOutput, nn.Conv1d):
    pass


class _MixingConv2d(_MixOutput, nn.Conv2d):
    pass


def _mixing_conv(conv: nn.Module) -> nn.Module:
    """A copy of ``conv`` (same weights) whose output mixes the samples."""
    cls = _MixingConv2d if isinstance(conv, nn.Conv2d) else _MixingConv1d
    new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, padding=conv.padding)
    new.load_state_dict(conv.state_dict())
    return new


def test_train_mode_after_an_eval_mode_first_call_is_refused_like_a_fresh_copy():
    model = nn.Sequential(
        nn.Conv2d(2, 2, 3, padding=1), _CentreInTraining(), nn.Tanh(), nn.Conv2d(2, 1, 1)
    ).eval()
    x, y = _batch()
    _mc(model, x, y, 1)  # verified in eval mode: the centring is the identity
    model.train()
    err = _assert_matches_fresh(model, x, y, numbers=False)
    assert isinstance(err, NotImplementedError)
    assert "'3' (Conv2d)" in str(err)
    assert "mixes the samples" in str(err)


SWAPS = {
    "act-to-mixing-tanh-subclass": lambda m: setattr(m, "act", _MixingTanh()),
    "conv2-to-mixing-conv-subclass": lambda m: setattr(m, "conv2", _mixing_conv(m.conv2)),
}


@pytest.mark.parametrize("swap", SWAPS.values(), ids=SWAPS.keys())
def test_a_leaf_swapped_for_a_mixing_subclass_is_refused_like_a_fresh_copy(swap):
    model = _Net()
    x, y = _batch()
    _mc(model, x, y, 1)
    swap(model)
    err = _assert_matches_fresh(model, x, y, numbers=False)
    assert isinstance(err, NotImplementedError)
    assert "mixes the samples" in str(err)


class _Scale(nn.Module):
    def forward(self, w):
        return 2 * w


class _DirectForward(_Net):
    """On inputs with a positive mean, also ``conv2.forward`` (bypassing hooks) on the input."""

    def forward(self, x):
        h = self.conv2(self.act(self.conv1(x)))
        if x.mean() > 0:
            h = h + self.conv2.forward(x.flip(-1))
        return self.head(self.act(h))


class _NoGradRegion(_Net):
    """On inputs with a positive mean, a ``torch.no_grad()`` region in ``forward``.

    ``"side"``: ``conv2`` on the flipped input, added as a constant; ``"entry"``: the entry
    convolution itself runs without grad (its curvature is then zero).
    """

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def forward(self, x):
        if self.where == "entry" and x.mean() > 0:
            with torch.no_grad():
                h = self.conv1(x)
        else:
            h = self.conv1(x)
        h = self.conv2(self.act(h))
        if self.where == "side" and x.mean() > 0:
            with torch.no_grad():
                h = h + self.conv2(x.flip(-1))
        return self.head(self.act(h))


def _tie(model):
    model.conv2.weight = model.conv1.weight  # both 2 → 2, 3×3


def _freeze(model):
    model.conv2.weight.requires_grad_(False)


def _replace_weight(model):
    model.conv2.weight = nn.Parameter(torch.randn_like(model.conv2.weight))


def _double_forward(model):
    def forward(self, x):
        return 2 * nn.Conv2d.forward(self, x)

    model.conv2.forward = types.MethodType(forward, model.conv2)


PARAMETER_CHANGES = {
    "parametrization-registered": lambda m: parametrize.register_parametrization(
        m.conv2, "weight", _Scale()
    ),
    "weight-norm-parametrization-added": lambda m: nn.utils.parametrizations.weight_norm(m.conv2),
    "conv2-weight-tied-to-conv1": _tie,
    "conv2-weight-frozen": _freeze,
    "conv2-weight-replaced-by-a-new-parameter": _replace_weight,
    "conv2-forward-replaced-on-the-instance": _double_forward,
}


@pytest.mark.parametrize("change", PARAMETER_CHANGES.values(), ids=PARAMETER_CHANGES.keys())
def test_a_change_to_parameters_or_forward_after_the_first_call(change):
    model = _Net()
    x, y = _batch()
    _mc(model, x, y, 1)
    change(model)
    _assert_matches_fresh(model, x, y)


class _BatchBranchScale(nn.Module):
    """A leaf whose forward branches on the whole batch's mean (no gradient path to see it)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([0.7, 1.3]).reshape(1, 2, 1, 1))

    def forward(self, x):
        return self.scale * x * (3.0 if x.mean() > 0 else 1.0)


def test_a_leaf_that_branches_on_the_batch_is_refused_when_the_branch_turns():
    # The first batch takes one branch in the batch and in every sample's replay alike; the
    # second takes the other in the batch but not in the negative samples' replays, whose
    # per-sample gradients were then a third of the right ones, silently.
    model = nn.Sequential(_BatchBranchScale(), nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 1, 1))
    x1, y1 = _batch(sign=-1.0)
    _mc(model, x1, y1, 1)
    x2 = torch.cat([x1[:1], torch.randn(2, 2, 5, 5) + 3.0])  # batch mean > 0, sample 0's < 0
    assert x2.mean() > 0 > x2[0].mean()
    err = _assert_matches_fresh(model, x2, y1, numbers=False)
    assert isinstance(err, NotImplementedError)
    assert "'0' (_BatchBranchScale)" in str(err)
    assert "does not treat the samples independently" in str(err)


def test_a_batch_size_change_between_calls():
    model = _Net()
    _mc(model, *_batch(3), 1)
    _assert_matches_fresh(model, *_batch(4))


LATER_PATHS = {  # model whose forward takes another path on inputs with a positive mean
    "conv2.forward-called-directly": _DirectForward,
    "no-grad-region-around-a-second-conv2-call": lambda: _NoGradRegion("side"),
    "no-grad-region-around-the-entry-conv1": lambda: _NoGradRegion("entry"),
}


@pytest.mark.parametrize("build", LATER_PATHS.values(), ids=LATER_PATHS.keys())
def test_a_path_through_forward_taken_only_on_later_inputs(build):
    model = build()
    _mc(model, *_batch(sign=-1.0), 1)
    _assert_matches_fresh(model, *_batch(sign=1.0))


# -- random networks, random changes -----------------------------------------------------------

CHANGES = (
    "nothing", "hook-2o", "hook-0.5o+1", "in-place-hook", "global-hook", "train-mode",
    "swap-act", "swap-conv", "branch", "batch-size",
)  # fmt: skip


@dataclass(frozen=True)
class _Spec:
    """A random network (float64, tiny) and the change applied after its first call.

    ``depth`` convolutions with activations (the first followed by an optional norm and, with
    ``centre``, a layer that centres over the batch in training mode), an optional skip
    ``torch.cat`` of the first hidden state into the 1×1 head, and with ``branch`` a
    convolution on the flipped input added for inputs with a positive mean. ``target`` picks
    the convolution (``depth``: the head) or activation the change touches.
    """

    seed: int
    change: str
    dims: int
    depth: int
    width: int
    size: int
    act: str
    norm: str
    skip: bool
    branch: bool
    centre: bool
    target: int
    loss: str

    @property
    def id(self) -> str:
        extras = [e for e, on in (("skip", self.skip), ("branch", self.branch),
                                  ("centre", self.centre)) if on]  # fmt: skip
        where = "head" if self.target == self.depth else f"at{self.target}"
        change = self.change + (f"-{where}" if "hook" in self.change or "swap" in self.change
                                else "")  # fmt: skip
        return "-".join([f"s{self.seed}", change, f"conv{self.dims}d",
                         f"x{self.depth}", self.act, self.norm, *extras, self.loss])  # fmt: skip


def _spec(seed: int) -> _Spec:
    """The change ``CHANGES[seed % 10]``; the network drawn by ``random.Random(seed)``."""
    rng = random.Random(seed)
    change = CHANGES[seed % len(CHANGES)]
    depth = rng.randint(2, 4)
    swap = change.startswith("swap")
    return _Spec(
        seed=seed,
        change=change,
        dims=rng.choice((1, 2)),
        depth=depth,
        width=rng.choice((2, 3)),
        size=rng.choice((4, 5)),
        act=rng.choice(("relu", "tanh")),
        norm=rng.choice(("none", "group", "instance", "batch")),
        skip=rng.random() < 0.5,
        branch=change == "branch" or rng.random() < 0.3,
        centre=change == "train-mode" or rng.random() < 0.3,
        target=rng.randrange(depth if swap else depth + 1),
        loss=rng.choice(("bce", "ce")),
    )


class _RandomNet(nn.Module):
    """The network a :class:`_Spec` describes (random weights from torch's global seed)."""

    def __init__(self, s: _Spec):
        super().__init__()
        conv = nn.Conv1d if s.dims == 1 else nn.Conv2d
        w = s.width
        self.convs = nn.ModuleList(
            conv(2 if i == 0 else w, w, 3, padding=1) for i in range(s.depth)
        )
        act = nn.Tanh if s.act == "tanh" else nn.ReLU
        self.acts = nn.ModuleList(act() for _ in range(s.depth))
        norms = {
            "none": nn.Identity,
            "group": lambda: nn.GroupNorm(1, w),
            "instance": lambda: (nn.InstanceNorm1d if s.dims == 1 else nn.InstanceNorm2d)(
                w, affine=True
            ),
            "batch": lambda: nn.BatchNorm1d(w) if s.dims == 1 else nn.BatchNorm2d(w),
        }
        self.norm = _randomised(norms[s.norm]())
        self.centre = _CentreInTraining() if s.centre else nn.Identity()
        self.extra = conv(2, w, 3, padding=1) if s.branch else None
        self.skip = s.skip
        self.head = conv(2 * w if s.skip else w, 1 if s.loss == "bce" else 3, 1)

    def forward(self, x):
        h = first = self.acts[0](self.centre(self.norm(self.convs[0](x))))
        for conv, act in zip(self.convs[1:], self.acts[1:], strict=True):
            if self.extra is not None and h is first and x.mean() > 0:
                h = h + self.extra(x.flip(-1))
            h = act(conv(h))
        return self.head(torch.cat([h, first], 1) if self.skip else h)


def _data(s: _Spec, n: int, sign: float):
    spatial = (s.size + 2,) if s.dims == 1 else (s.size, s.size)
    x = torch.randn(n, 2, *spatial) + sign
    if s.loss == "bce":
        return x, (torch.rand(n, 1, *spatial) > 0.5).double()
    return x, torch.randint(0, 3, (n, *spatial))


def _change(s: _Spec, model: _RandomNet):
    """Applies the change; returns a hook handle to remove afterwards, or None."""
    modules = [*model.convs, model.head]
    if s.change == "hook-2o":
        return modules[s.target].register_forward_hook(lambda _, a, o: 2 * o)
    if s.change == "hook-0.5o+1":
        return modules[s.target].register_forward_hook(lambda _, a, o: 0.5 * o + 1)
    if s.change == "in-place-hook":
        return modules[s.target].register_forward_hook(lambda _, a, o: o.mul_(2))
    if s.change == "global-hook":
        modules[s.target].scaled_by_test_hook = True
        return nn.modules.module.register_module_forward_hook(
            lambda m, a, o: 2 * o if getattr(m, "scaled_by_test_hook", False) else None
        )
    if s.change == "train-mode":
        model.train()
    elif s.change == "swap-act":
        model.acts[s.target] = _MixingTanh() if s.act == "tanh" else _MixingReLU()
    elif s.change == "swap-conv":
        model.convs[s.target] = _mixing_conv(model.convs[s.target])
    return None


def _changed(s: _Spec):
    """The model after its first (verified) call and the change, the hook handle, the batch."""
    model = _RandomNet(s).eval()
    x1, y1 = _data(s, 3, -1.0)
    _mc(model, x1, y1, 1, loss=s.loss)
    handle = _change(s, model)
    batch = _data(s, 4 if s.change == "batch-size" else 3, 1.0 if s.change == "branch" else -1.0)
    return model, handle, batch


SPECS = [_spec(seed) for seed in range(40)]
# Every change but "nothing" and "batch-size" failed on the code before the fix of issue 38.


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_random_change_second_call_equals_a_fresh_copy(spec):
    model, handle, (x, y) = _changed(spec)
    try:
        _assert_matches_fresh(model, x, y, loss=spec.loss, numbers=False)
    finally:
        if handle is not None:
            handle.remove()


# The first two networks of each change after which the model still has a GGN (no mixing).
Z_SPECS = [
    s
    for c in CHANGES
    if c not in ("train-mode", "swap-act", "swap-conv")
    for s in [s for s in SPECS if s.change == c][:2]
]


@pytest.mark.parametrize("spec", Z_SPECS, ids=[s.id for s in Z_SPECS])
def test_random_change_calls_after_it_are_unbiased_for_the_exact_diagonal(spec):
    """z-test of 200 draws after the change against the exact float64 GGN diagonal.

    20 calls of 10 draws each; the spread of the 20 per-call means of a tensor's trace gives
    their mean's standard error (``sd / √20``, 19 degrees of freedom): ``|z| < 5``.
    """
    model, handle, (x, y) = _changed(spec)
    calls = 20
    try:
        exact = exact_ggn_diagonal(model, x, y, spec.loss)
        per_call = [_mc(model, x, y, 100 + k, 10, spec.loss).diagonals for k in range(calls)]
    finally:
        if handle is not None:
            handle.remove()
    assert sum(float(d.sum()) for d in exact.values()) > 0
    bad = {}
    for name, d in exact.items():
        traces = torch.stack([diagonals[name].sum() for diagonals in per_call])
        mean, se, want = (
            float(traces.mean()),
            float(traces.std()) / math.sqrt(calls),
            float(d.sum()),
        )
        if se > 0 and not abs(mean - want) < 5 * se:
            bad[name] = f"z={(mean - want) / se:.3g} ({mean / want:.3g}x exact)"
        elif se == 0 and not math.isclose(mean, want, rel_tol=1e-9, abs_tol=1e-12):
            bad[name] = f"{mean:.6g} every call, exact {want:.6g}"
    assert not bad, bad
