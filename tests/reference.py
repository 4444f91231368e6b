"""Dense, brute-force references built on ``torch.func.jacrev``; independent of ``lsn_ext``.

Every quantity is computed from the full Jacobian, so these only suit small shapes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev


def jacobian_matrix(fn, x: Tensor) -> Tensor:
    """``J`` of shape ``[fn(x).numel(), x.numel()]``."""
    y = fn(x)
    return jacrev(fn)(x).reshape(y.numel(), x.numel())


def squared_input_rule(fn, x: Tensor, m_out: Tensor) -> Tensor:
    """``Σ_o J_oi² m_o`` shaped like ``x``, with ``J = ∂fn(x)/∂x``."""
    J = jacobian_matrix(fn, x)
    return (J.square().T @ m_out.reshape(-1)).reshape(x.shape)


def squared_param_rule(module: nn.Module, x: Tensor, m_out: Tensor) -> dict[str, Tensor]:
    """``{name: Σ_o J_oθ² m_o}`` for the module's own parameters."""
    params = {k: p.detach() for k, p in module.named_parameters(recurse=False)}
    if not params:
        return {}

    def f(p):
        return functional_call(module, p, (x,))

    jac = jacrev(f)(params)
    return {
        k: (jac[k].reshape(m_out.numel(), -1).square().T @ m_out.reshape(-1)).reshape(p.shape)
        for k, p in params.items()
    }


def block_input_rule(fn, x: Tensor, h_block: Tensor) -> Tensor:
    """``diag(J^T H J)`` for ``H`` block-diagonal over dim 1 of the output (``[N, C, C, *]``)."""
    y = fn(x)
    J = jacobian_matrix(fn, x)
    H = dense_block(h_block, y.shape)
    return torch.einsum("oi,op,pi->i", J, H, J).reshape(x.shape)


def dense_block(h_block: Tensor, y_shape: torch.Size) -> Tensor:
    """The dense ``[y.numel(), y.numel()]`` matrix of a per-position ``[N, C, C, *]`` block."""
    N, C = y_shape[0], y_shape[1]
    rest = int(torch.Size(y_shape[2:]).numel())
    idx = torch.arange(y_shape.numel()).reshape(N, C, rest)
    H = torch.zeros(y_shape.numel(), y_shape.numel(), dtype=h_block.dtype)
    hb = h_block.reshape(N, C, C, rest)
    for n in range(N):
        for s in range(rest):
            rows = idx[n, :, s]
            H[rows[:, None], rows[None, :]] = hb[n, :, :, s]
    return H


def assert_rule_matches(rule, module: nn.Module, x: Tensor, m_out: Tensor | None = None) -> None:
    """Check ``rule`` on ``module`` at ``x`` against the dense references.

    Checks input and parameter diagonals (values and shapes), non-negativity, that ``backward``
    agrees with the separate rules, and that neither the module nor the inputs were modified.
    """
    with torch.no_grad():
        y = module(x)
    if m_out is None:
        m_out = torch.rand_like(y)
    x0, m0 = x.clone(), m_out.clone()
    state0 = {k: v.clone() for k, v in module.state_dict().items()}

    m_in = rule.input_rule(module, x, y, m_out)
    expected = squared_input_rule(module, x, m_out)
    assert m_in.shape == x.shape
    torch.testing.assert_close(m_in, expected, rtol=1e-10, atol=1e-12)
    assert (m_in >= 0).all()

    diags = rule.param_rule(module, x, y, m_out)
    expected_p = squared_param_rule(module, x, m_out)
    assert set(diags) == set(expected_p)
    for k, d in diags.items():
        assert d.shape == expected_p[k].shape, k
        torch.testing.assert_close(d, expected_p[k], rtol=1e-10, atol=1e-12, msg=k)
        assert (d >= 0).all(), k

    m_in2, diags2 = rule.backward(module, x, y, m_out)
    torch.testing.assert_close(m_in2, m_in, rtol=1e-12, atol=1e-14)
    assert set(diags2) == set(diags)
    for k in diags:
        torch.testing.assert_close(diags2[k], diags[k], rtol=1e-12, atol=1e-14)

    torch.testing.assert_close(x, x0, rtol=0, atol=0)
    torch.testing.assert_close(m_out, m0, rtol=0, atol=0)
    for k, v in module.state_dict().items():
        torch.testing.assert_close(v, state0[k], rtol=0, atol=0)


def dense_db(net, x: Tensor, h_diag: Tensor, h_block: Tensor | None = None) -> dict[str, Tensor]:
    """DB by brute force on a :class:`tests.networks.GraphNet`: ``D`` after every node.

    Each node's ``Σ_o J_oi² m_o`` comes from its dense Jacobian (jacrev) w.r.t. each input and
    each parameter; fan-out sums. With ``h_block``, the output node uses ``diag(Jᵀ H J)`` for its
    input (the exact cross-entropy first step) and ``h_diag`` for its parameters.
    """
    values = {"x": x.detach()}
    with torch.no_grad():
        for out, op, ins in net.nodes:
            values[out] = net.op(op)(*[values[i] for i in ins])
    names = {id(p): n for n, p in net.named_parameters()}
    diag = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    m = {net.output: h_diag}
    for out, op, ins in reversed(net.nodes):
        m_out = m.pop(out, None)
        if m_out is None:
            continue
        f = net.op(op)
        args = [values[i] for i in ins]
        for j, name in enumerate(ins):

            def fj(z, j=j, args=args, f=f):
                return f(*args[:j], z, *args[j + 1 :])

            if h_block is not None and out == net.output:
                contribution = block_input_rule(fj, args[j], h_block)
            else:
                contribution = squared_input_rule(fj, args[j], m_out)
            m[name] = m.get(name, 0) + contribution
        if isinstance(op, str):
            for k, d in squared_param_rule(f, args[0], m_out).items():
                diag[names[id(getattr(f, k))]] += d
    return diag


def dense_ggn_diag(model: nn.Module, x: Tensor, loss) -> dict[str, Tensor]:
    """The exact GGN diagonal ``Σ diag(Jᵀ H J)`` from the full Jacobian w.r.t. all parameters."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    f = functional_call(model, params, (x,))
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    H = loss_hessian_dense(loss, f)
    out = {}
    for n, p in params.items():
        J = jac[n].reshape(f.numel(), -1)
        out[n] = torch.einsum("oi,op,pi->i", J, H, J).reshape(p.shape)
    return out


def loss_hessian_dense(loss, f: Tensor) -> Tensor:
    """The dense Hessian of ``loss`` (a callable of the logits) by ``torch.func.hessian``."""
    from torch.func import hessian

    return hessian(loss)(f.detach()).reshape(f.numel(), f.numel())


# -- forward (linearised variance) references ------------------------------------------------


def squared_forward_input_rule(fn, x: Tensor, v_in: Tensor) -> Tensor:
    """``Σ_i J_oi² v_i`` shaped like ``fn(x)``, with ``J = ∂fn(x)/∂x``."""
    y = fn(x)
    J = jacobian_matrix(fn, x)
    return (J.square() @ v_in.reshape(-1)).reshape(y.shape)


def squared_forward_param_rule(
    module: nn.Module, x: Tensor, param_var: dict, kwargs: dict | None = None
) -> Tensor:
    """``Σ_θ J_oθ² σ²_θ`` over the module's own parameters named in ``param_var``.

    ``kwargs`` are passed to the module's forward with ``x``.
    """
    params = {k: p.detach() for k, p in module.named_parameters(recurse=False)}
    y = functional_call(module, params, (x,), kwargs)
    out = torch.zeros(y.numel(), dtype=y.dtype)
    if not params:
        return out.reshape(y.shape)
    jac = jacrev(lambda p: functional_call(module, p, (x,), kwargs))(params)
    for k, var in param_var.items():
        out += jac[k].reshape(y.numel(), -1).square() @ var.reshape(-1)
    return out.reshape(y.shape)


def exact_linearized_variance(model: nn.Module, x: Tensor, param_var: dict) -> Tensor:
    """The exact ``Var f_o = Σ_θ J_oθ² σ²_θ`` from the full Jacobian w.r.t. the parameters."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    f = functional_call(model, params, (x,))
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    out = torch.zeros(f.numel(), dtype=f.dtype)
    for k, var in param_var.items():
        out += jac[k].reshape(f.numel(), -1).square() @ var.reshape(-1)
    return out.reshape(f.shape)


def assert_forward_rule_matches(rule, module: nn.Module, x: Tensor, **kwargs) -> None:
    """Check ``rule.forward_rule`` on ``module`` at ``x`` against the dense references.

    Random input variance and random variances for every own parameter; then zero input
    variance (``None``), no parameter variance, and each parameter alone (missing names are
    zero). Also checks shapes, non-negativity, and that nothing was modified. ``kwargs`` are
    passed to the module's forward with ``x`` (e.g. ``output_size``).
    """

    def fn(t):
        return module(t, **kwargs)

    with torch.no_grad():
        y = fn(x)
    v_in = torch.rand_like(x)
    param_var = {k: torch.rand_like(p) for k, p in module.named_parameters(recurse=False)}
    x0, v0 = x.clone(), v_in.clone()
    pv0 = {k: v.clone() for k, v in param_var.items()}
    state0 = {k: v.clone() for k, v in module.state_dict().items()}

    from_input = squared_forward_input_rule(fn, x, v_in)
    # Each parameter's own term, then their sum.
    own = {k: squared_forward_param_rule(module, x, {k: v}, kwargs) for k, v in param_var.items()}
    from_params = sum(own.values(), torch.zeros_like(y))
    cases = {
        "input+params": (v_in, param_var, from_input + from_params),
        "input-only": (v_in, {}, from_input),
        "params-only": (None, param_var, from_params),
    }
    for k in param_var:
        cases[f"only-{k}"] = (None, {k: param_var[k]}, own[k])
    for name, (v, pv, expected) in cases.items():
        v_out = rule.forward_rule(module, x, y, v, pv)
        assert v_out.shape == y.shape, name
        torch.testing.assert_close(v_out, expected, rtol=1e-10, atol=1e-12, msg=name)
        assert (v_out >= 0).all(), name
    zero = rule.forward_rule(module, x, y, None, {})
    assert zero.shape == y.shape
    assert (zero == 0).all()

    torch.testing.assert_close(x, x0, rtol=0, atol=0)
    torch.testing.assert_close(v_in, v0, rtol=0, atol=0)
    for k, v in param_var.items():
        torch.testing.assert_close(v, pv0[k], rtol=0, atol=0)
    for k, v in module.state_dict().items():
        torch.testing.assert_close(v, state0[k], rtol=0, atol=0)


def dense_forward(net, x: Tensor, param_var: dict) -> Tensor:
    """Forward "D after every layer" by brute force on a :class:`tests.networks.GraphNet`.

    Each node's output variance is ``Σ_j (J_j ∘ J_j) v_j + Σ_θ (J_θ ∘ J_θ) σ²_θ`` from its dense
    Jacobians (jacrev) w.r.t. each input ``j`` and each own parameter; the input has zero
    variance. ``param_var`` maps names of ``net.named_parameters()`` to variances (missing: 0).
    Returns the variance of the output node.
    """
    values = {"x": x.detach()}
    var = {"x": torch.zeros_like(x)}
    names = {id(p): n for n, p in net.named_parameters()}
    with torch.no_grad():
        for out, op, ins in net.nodes:
            f = net.op(op)
            args = [values[i] for i in ins]
            values[out] = f(*args)
            total = torch.zeros_like(values[out])
            for j, name in enumerate(ins):

                def fj(z, j=j, args=args, f=f):
                    return f(*args[:j], z, *args[j + 1 :])

                total += squared_forward_input_rule(fj, args[j], var[name])
            if isinstance(op, str):
                own = {
                    k: param_var[names[id(p)]]
                    for k, p in f.named_parameters(recurse=False)
                    if names[id(p)] in param_var
                }
                total += squared_forward_param_rule(f, args[0], own)
            var[out] = total
    return var[net.output]
