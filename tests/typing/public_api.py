"""A user's script, checked by ``mypy --strict`` (tests/test_typing.py), never run.

Each public name is used as the README uses it; ``assert_type`` fails the check where lsn_ext's
annotations would leave a user with ``Any`` (or with the wrong type). ``--strict`` also fails it
where a public function or class has unannotated parameters (``no-untyped-call``).
"""

from typing import assert_type

import torch
from laplace import Laplace
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lsn_ext
from lsn_ext.models import UNet

images = torch.randn(4, 3, 16, 16)
labels = torch.randint(0, 3, (4, 16, 16))
unet = UNet(3, 3, widths=(4, 8))

result = lsn_ext.diag_backprop(unet, images, labels, "ce")
assert_type(result, lsn_ext.DiagBackpropResult)
assert_type(result.diagonals, dict[str, Tensor])
assert_type(lsn_ext.ggn_diagonal(unet, images, labels, estimator="mc"), lsn_ext.DiagBackpropResult)

backend: type[lsn_ext.DiagBackprop] = lsn_ext.DiagBackprop
la = Laplace(
    unet, "classification", subset_of_weights="all", hessian_structure="diag", backend=backend
)
la.fit(DataLoader(TensorDataset(images, labels), batch_size=2))
prediction = lsn_ext.predict(la, images, n_samples=4, window=lsn_ext.SlidingWindow(roi_size=(8, 8)))
assert_type(prediction, lsn_ext.SegmentationPrediction)
assert_type(prediction.variance, Tensor)
grid = lsn_ext.gridsearch_prior_precision(la, DataLoader(TensorDataset(images, labels)))
assert_type(grid, lsn_ext.GridSearchResult)

dirichlet = lsn_ext.laplace_bridge(torch.zeros(5, 3), torch.ones(5, 3))
assert_type(dirichlet, lsn_ext.BridgeDirichlet)
assert_type(dirichlet.probs, Tensor)
assert_type(dirichlet.topk(threshold=0.05), lsn_ext.TopK)
assert_type(lsn_ext.LaplaceBridge()(torch.zeros(5, 3), torch.ones(5, 3)), lsn_ext.BridgeDirichlet)
assert_type(lsn_ext.dirichlet_to_gaussian(dirichlet.alpha), tuple[Tensor, Tensor])

variance = lsn_ext.linearized_variance(unet, images, torch.ones(1))
assert_type(variance, tuple[Tensor, Tensor])

picked: nn.Module = lsn_ext.SelectInput(unet, key="image")
assert_type(lsn_ext.supported_modules(), list[str])
assert_type(lsn_ext.__version__, str)
