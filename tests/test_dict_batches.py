"""MONAI-style pipelines: dictionary batches, ``MetaTensor`` inputs and ``[N, 1, *]`` labels
through ``SelectInput``, ``DiagBackprop``, ``predict`` and ``gridsearch_prior_precision``, against
the same data given as ``(x, y)`` tensor batches."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext import (
    CrossEntropy,
    DiagBackprop,
    SelectInput,
    gridsearch_prior_precision,
    predict,
)
from lsn_ext._laplace import Laplace
from tests.model_state import assert_unchanged, snapshot

monai_data = pytest.importorskip("monai.data")
monai_nets = pytest.importorskip("monai.networks.nets")

N, C, K, S = 4, 1, 3, 32


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = monai_nets.BasicUNet(
        spatial_dims=2, in_channels=C, out_channels=K, features=(4, 4, 8, 8, 8, 4)
    )
    return net.double().eval()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, C, S, S, generator=g, dtype=torch.float64)
    return x, torch.randint(0, K, (N, 1, S, S), generator=g)


def _dict_loader() -> DataLoader:
    """What a MONAI pipeline yields: dictionaries of MetaTensors, labels ``[N, 1, H, W]``."""
    x, y = _data()
    items = [
        {"image": monai_data.MetaTensor(xi), "label": monai_data.MetaTensor(yi), "id": i}
        for i, (xi, yi) in enumerate(zip(x, y, strict=True))
    ]
    return monai_data.DataLoader(items, batch_size=2)


def _tuple_loader() -> DataLoader:
    x, y = _data()
    return DataLoader(TensorDataset(x, y[:, 0]), batch_size=2)


def _laplace(model: nn.Module, **kwargs) -> Laplace:
    return Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=DiagBackprop,
        backend_kwargs={"estimator": "db"},
        **kwargs,
    )


@pytest.fixture(scope="module")
def fitted():
    """The posterior from dictionary batches and the one from tensor batches."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        net = _net()
        la_dict = _laplace(SelectInput(net, "image"), dict_key_x="image", dict_key_y="label")
        la_dict.fit(_dict_loader())
        la_plain = _laplace(_net())
        la_plain.fit(_tuple_loader())
    finally:
        torch.set_default_dtype(dtype)
    return la_dict, la_plain


def test_dictionary_batches_give_the_curvature_of_tensor_batches(fitted):
    la_dict, la_plain = fitted
    assert la_dict.H.abs().sum() > 0
    torch.testing.assert_close(la_dict.H, la_plain.H)
    torch.testing.assert_close(la_dict.loss, la_plain.loss)
    assert la_dict.n_data == la_plain.n_data == N


def test_predict_takes_the_dictionary_or_its_tensor(fitted):
    la_dict, _ = fitted
    batch = next(iter(_dict_loader()))
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    from_dict = predict(la_dict, batch, 4, generator=gen())
    from_tensor = predict(la_dict, batch["image"].as_tensor(), 4, generator=gen())
    assert type(from_dict.mean) is torch.Tensor  # no MetaTensor leaks out
    torch.testing.assert_close(from_dict.mean, from_tensor.mean)
    torch.testing.assert_close(from_dict.variance, from_tensor.variance)


def test_grid_search_scores_dictionary_batches_like_tensor_batches(fitted):
    la_dict, la_plain = fitted
    grid = [0.1, 10.0, 1000.0]
    a = gridsearch_prior_precision(la_dict, _dict_loader(), grid=grid, n_samples=4)
    b = gridsearch_prior_precision(la_plain, _tuple_loader(), grid=grid, n_samples=4)
    assert a.prior_precision == b.prior_precision
    torch.testing.assert_close(torch.tensor(a.scores), torch.tensor(b.scores))


def test_select_input_leaves_the_network_unchanged():
    net = _net()
    snap = snapshot(net)
    la = _laplace(SelectInput(net, "image"), dict_key_x="image", dict_key_y="label")
    la.fit(_dict_loader())
    predict(la, next(iter(_dict_loader())), 2)
    net.eval()  # laplace-torch's fit calls eval(); the network was in eval mode already
    assert_unchanged(net, snap)


BAD = {
    "model-takes-the-dictionary-whole": (
        lambda: DiagBackprop(_net(), "classification", dict_key_x="image"),
        r"got a dictionary batch \(keys \['id', 'image', 'label'\]\) for a BasicUNet.*"
        r"SelectInput\(net, 'image'\)",
    ),
    "key-mismatch": (
        lambda: DiagBackprop(SelectInput(_net(), "img"), "classification", dict_key_x="image"),
        r"SelectInput takes the key 'img' but dict_key_x is 'image'",
    ),
    "laplace-default-key": (
        lambda: DiagBackprop(SelectInput(_net(), "image"), "classification"),
        r"SelectInput takes the key 'image' but dict_key_x is 'input_ids'",
    ),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_dictionary_batch_misuse_is_refused(case):
    make, pattern = case
    backend = make()
    batch = next(iter(_dict_loader()))
    with pytest.raises(ValueError, match=pattern):
        backend.diag(batch, batch["label"].as_tensor())


def test_select_input_names_a_missing_key():
    with pytest.raises(KeyError, match=r"no key 'img' \(keys: \['id', 'image', 'label'\]\)"):
        SelectInput(_net(), "img")(next(iter(_dict_loader())))


def test_cross_entropy_takes_label_maps_with_a_channel_axis():
    logits = torch.randn(2, K, 4, 4)
    y = torch.randint(0, K, (2, 1, 4, 4))
    loss = CrossEntropy()
    torch.testing.assert_close(loss.value(logits, y), loss.value(logits, y[:, 0]))
    torch.testing.assert_close(loss.hessian_diag(logits, y), loss.hessian_diag(logits, y[:, 0]))
    with pytest.raises(ValueError, match=r"cast them with \.long\(\)"):
        loss.value(logits, y.double())
