"""The native diagonal-backprop engine: DB on an ordinary ``nn.Module``.

``diag_backprop(model, inputs, targets, loss)`` runs one forward pass in which

- every module with a rule in :data:`lsn_ext.rules.RULES` runs as one node of a custom autograd
  function whose backward applies that rule (the module's parameters are inputs of the node, so
  their DB diagonals arrive as the "gradients" of one ``torch.autograd.grad`` call, summed over
  repeated calls of a shared module);
- layers whose Jacobian has only 0/1 entries (ReLU, max pooling, flatten, dropout in evaluation
  mode) and structural operations in ``forward`` (``torch.cat``, slicing, reshapes, padding,
  addition, nearest upsampling) are left to autograd: squaring their Jacobian changes nothing, so
  the ordinary backward pass already is the DB step. Fan-out sums, which gives LSN Eq. (27) for
  concatenating skip connections, nested or not;
- a ``TorchFunctionMode`` inspects every other operation in ``forward`` that touches the graph:
  functional activations (``torch.tanh(x)``: the rules' functional forms), constant scaling
  (``0.5 * x``, ``x / c``, ``-x``, ``a - b``, ``x.mean()``), ``F.interpolate`` and
  ``F.avg_pool*d`` are routed through the same rules; anything else raises an error naming the
  operation and the module it is called in.

Granularity: the diagonal is taken after every registered module and every functional operation
above; a module's internals are one layer. ``Conv2d(padding_mode="reflect")`` is padding followed
by a convolution (see :class:`~lsn_ext.rules.ConvRule`).

The model is left as found: forward hooks and per-instance ``forward`` overrides are installed for
the duration of the call only and removed in a ``finally`` block; parameters, buffers, modes and
``requires_grad`` flags are not touched.

The package, by job:

- :mod:`~lsn_ext.engine.driver`: :func:`diag_backprop` and :class:`DiagBackpropResult`;
- :mod:`~lsn_ext.engine.checks`: the checks of inputs, logits and diagonals (shared with the
  estimators);
- :mod:`~lsn_ext.engine.session`: the :class:`Session` of one pass (installation, bookkeeping,
  the ``TorchFunctionMode``);
- :mod:`~lsn_ext.engine.functions`: the autograd Functions (rule nodes, scaling, products);
- :mod:`~lsn_ext.engine.handlers`: the table of functional handlers;
- :mod:`~lsn_ext.engine.forward`: the forward counterpart, :func:`linearized_variance`.
"""

from lsn_ext.engine.checks import (
    all_finite,
    check_db_diagonals,
    check_finite_logits,
    check_finite_result,
    check_inputs,
    check_logits,
    round_off,
    select_params,
    sum_tolerance,
)
from lsn_ext.engine.driver import DiagBackpropResult, diag_backprop
from lsn_ext.engine.forward import linearized_variance
from lsn_ext.engine.handlers import bind_arguments
from lsn_ext.engine.session import ModeAside, Session, all_modules, is_parametrized

__all__ = [
    "DiagBackpropResult",
    "ModeAside",
    "Session",
    "all_finite",
    "all_modules",
    "bind_arguments",
    "check_db_diagonals",
    "check_finite_logits",
    "check_finite_result",
    "check_inputs",
    "check_logits",
    "diag_backprop",
    "is_parametrized",
    "linearized_variance",
    "round_off",
    "select_params",
    "sum_tolerance",
]
