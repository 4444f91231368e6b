r"""StochMan ``nnj`` adapter: skip connections, the SSN mean head and diagonal sandwiches.

::

    from stochman import nnj
    from lsn_ext import stochman_ext as sx

    mean_net = nnj.Sequential(                        # the LSN "mean network"
        sx.Conv2d(3, 8, 3, padding=1), sx.Tanh(),
        sx.SkipConnection(sx.MaxPool2d(2), sx.Conv2d(8, 8, 3, padding=1), sx.Tanh(),
                          sx.Upsample(scale_factor=2)),          # cat([x, F(x)], dim=1)
        sx.Conv2d(16, 8, 3, padding=1), sx.Tanh(),
        sx.MeanHead(8, num_classes=2),
    )
    res = sx.diag_backprop_nnj(mean_net, x, y, "ce")  # .diagonals {name: diag}, .vector

    net = sx.to_nnj(lsn_ext.models.UNet(3, 2))        # nested SkipConnections, shared weights

Diagonal backpropagation (DB) needs, per module, the two StochMan "sandwiches" with a diagonal
``M`` in and out: ``D(J_xᵀ diag(m) J_x) = (J_x ∘ J_x)ᵀ m`` and ``D(J_θᵀ diag(m) J_θ)``. Every
leaf module here computes them by calling its rule from the rule table
(:data:`lsn_ext.rules.RULES`); no layer's maths is written twice. Containers recurse:

- :class:`Sequential` (and any ``nn.Sequential`` / ``nnj.Sequential`` inside a network) runs the
  DB chain of LSN Alg. 3: forward once, then ``m ← D(J_kᵀ diag(m) J_k)`` for ``k = L … 1``.
- :class:`SkipConnection` computes ``SC(x) = cat([x, F(x)], dim)``, ``J_SC = [I; J_F]``, and
  implements LSN Eq. (27): with ``m = (m_x, m_F)`` split along ``dim``,
  ``D(J_SCᵀ M J_SC) = D(J_Fᵀ M_F J_F) + M_x`` (input) and the parameter diagonals of ``F``
  alone (weights). ``F`` is a :class:`Sequential`, so nested skip connections recurse.

:func:`diag_backprop_nnj` runs a whole network through the native engine,
:func:`lsn_ext.diag_backprop` (one DB driver in lsn_ext, not two): one forward pass with every
registered layer as a node of the recursion, the loss Hessian diagonal
``as_loss(loss).hessian_diag`` (for cross-entropy by default the exact per-pixel block through
the head, ``rule.input_rule_block``), then one backward pass in which autograd's sum at each
concatenation is Eq. (27). Before that it checks what a StochMan network promises: plain chains,
skip connections and registered layers only, one tensor input, the head last. The containers'
sandwiches run the same engine on the container. On an equivalent ``nn.Module`` the diagonals
agree to round-off: both take the diagonal after every registered module, and concatenation, max
pooling and nearest upsampling are exact.

Registration. The rule table looks modules up by exact class. :func:`register` (run on import of
this package, idempotent) registers StochMan's own ``nnj`` classes whose ``forward`` computes what
their ``torch.nn`` parent computes, and the classes of this package, each with its parent's rule;
after that, the native engine, and so laplace-torch's ``DiagBackprop`` backend, run on ``nnj``
models directly: ``Laplace(nnj_model, ..., backend=lsn_ext.DiagBackprop)``. ``nnj`` classes with
another ``forward`` (``ArcTanh`` subclasses ``nn.Tanh``, ``PosLinear`` ``nn.Linear``) are not
registered.

What StochMan 0.3.0 forced on this adapter (measured):

- ``nnj.Sequential`` has no sandwich methods and StochMan no DB driver: :class:`Sequential` and
  :func:`diag_backprop_nnj` provide them; there is no ``SkipConnection`` at all.
- Layout. ``tmp`` of a diag→diag sandwich is flattened per sample, ``[B, prod(out_shape)]``,
  and the input sandwich returns ``[B, prod(in_shape)]``; the weight sandwich returns
  **per-sample** diagonals ``[B, P]`` (weight flattened, then bias), ``None`` for layers without
  parameters. The methods here keep that contract (and also accept ``tmp`` shaped like the
  output, then answer shaped like the input); per-sample weight diagonals cost one rule call per
  sample, so the network driver sums over the batch inside the rules instead.
- ``nnj.Upsample``'s diag→diag sandwich convolves with a ``ones(C, C, s, s)`` kernel: it sums
  over all channels (wrong for ``C > 1``), treats every mode as nearest (wrong for bilinear even
  with ``C = 1``), allows integer scale factors only, and builds the kernel in the *default*
  dtype (a float64 model under float32 default fails). :class:`Upsample` uses
  :class:`~lsn_ext.rules.UpsampleRule`: exact for any channel count, mode and dtype.
- ``nnj.Conv2d``'s diag sandwiches fail for strides that drop input rows (``output_padding=0``)
  and its weight sandwich for any stride > 1; it accumulates in the default dtype. :class:`Conv2d`
  uses :class:`~lsn_ext.rules.ConvRule` (any stride, padding, dilation, groups).
- Only the diag→diag paths are replaced. Full→full and the mixed paths stay StochMan's where it
  has them (``Linear``, ``Conv2d``, ``MaxPool2d``, ``Tanh``, ``Reshape``, ``Flatten``; nearest,
  integer-scale, default-dtype ``Upsample``) and raise ``NotImplementedError`` elsewhere; DB uses
  diag→diag only.
- ``nnj.MaxPool*d.forward`` stores the pooling indices on the module (``self.idx``); the rules
  do not use them.

The package, by job:

- :mod:`~lsn_ext.stochman_ext.layers`: the leaf layers, their sandwiches by their rules, and
  :data:`~lsn_ext.stochman_ext.layers.SAME_FORWARD` with :func:`register` (the classes whose
  ``forward`` is their ``torch.nn`` parent's, each registered with that parent's rule);
- :mod:`~lsn_ext.stochman_ext.containers`: :class:`Sequential`, :class:`SkipConnection`, their
  sandwiches by the engine, and the structure check;
- :mod:`~lsn_ext.stochman_ext.driver`: :func:`diag_backprop_nnj`;
- :mod:`~lsn_ext.stochman_ext.convert`: :func:`to_nnj`.
"""

from lsn_ext.stochman_ext.containers import Sequential, SkipConnection
from lsn_ext.stochman_ext.convert import to_nnj
from lsn_ext.stochman_ext.driver import diag_backprop_nnj
from lsn_ext.stochman_ext.layers import (
    ELU,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    Flatten,
    Identity,
    LeakyReLU,
    Linear,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
    MeanHead,
    ReLU,
    Reshape,
    Sigmoid,
    Softplus,
    Tanh,
    Upsample,
    register,
)

__all__ = [
    "ELU",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "Flatten",
    "Identity",
    "LeakyReLU",
    "Linear",
    "MaxPool1d",
    "MaxPool2d",
    "MaxPool3d",
    "MeanHead",
    "ReLU",
    "Reshape",
    "Sequential",
    "Sigmoid",
    "SkipConnection",
    "Softplus",
    "Tanh",
    "Upsample",
    "diag_backprop_nnj",
    "register",
    "to_nnj",
]

# Registration on import: StochMan's nnj layers and this package's classes get their rules.
register()
