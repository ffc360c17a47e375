"""``overlapc::grouped_mm``: a grouped matmul of any dtype on any device, run group by group.

A dropless MoE written as a Python loop of per-expert matmuls (passes/expert_loop.py) is
rewritten into calls of this op, so that the pipeline of passes/dropless.py sees one
row-wise body with run-time group offsets, as it does for ``torch._grouped_mm``. It follows
``_grouped_mm``'s semantics for its two offset forms::

    grouped_mm(a (R, K), b (G, K, N), offs) -> (R, N)       rows [offs[g-1], offs[g]) by b[g]
    grouped_mm(a (K, R), b (R, N), offs)    -> (G, K, N)    the sum over group g's rows

and, with ``index`` (group g -> which of ``b``'s weights), an expert bank used as it is
instead of a stacked copy per group (a loop over (source rank, local expert) groups reads
each local expert once per source rank)::

    grouped_mm(a (R, K), b (E, K, N), offs, index) -> (R, N)          rows of group g by b[index[g]]
    grouped_mm(a (K, R), b (R, N), offs, index, E) -> (E, K, N)       group sums added per index

``offs`` holds the groups' cumulative row counts (int32 or int64; the last is R).

Under autocast (an expert loop inside ``torch.autocast``) the op follows ``mm``'s rule: its
autocast kernel casts ``mat_a`` to the autocast dtype, and the op casts each group's weight
``mat_b[g]`` to ``mat_a``'s dtype as it uses it, as the loop's ``mm`` did per group; the
weight-gradient form then adds each group's product in ``out_dtype`` (the weights' own dtype),
as eager's autograd adds the per-group gradients after their cast back. Each group
runs as the ``mm`` the user's loop ran, on the same rows, so the forward is bit-for-bit the
loop's; the backward is this op again (``_grouped_mm``'s own kernels take only bf16 on the
CPU and need 16-byte aligned operands on CUDA; this op has neither restriction, and no
kernel of its own either: its speed is that of the loop it replaces).
"""

from __future__ import annotations

from typing import List, Optional  # noqa: UP035 -- see _grouped_mm_loop's signature

import torch


def _ends(offs: torch.Tensor) -> list[int]:
    return [int(e) for e in offs.tolist()]


# Optional[List[int]]: typing's spelling, which every torch's schema inference reads (2.11 too).
@torch.library.custom_op("overlapc::grouped_mm", mutates_args=())
def grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor,
    index: Optional[List[int]] = None,  # noqa: UP006, UP045
    n_out: int = -1,
    out_dtype: Optional[torch.dtype] = None,  # noqa: UP045
) -> torch.Tensor:
    """See the module docstring. ``index``: group g uses weight ``mat_b[index[g]]`` (an expert
    bank indexed per group: no stacked copy of the weights), and in the weight-gradient
    form adds its sum into ``out[index[g]]`` of ``n_out`` weights. Products are computed in
    ``mat_a``'s dtype (a weight of another dtype is cast per group, as autocast's ``mm`` does;
    passes/expert_loop.py emits mixed dtypes only under autocast, where eager's loop casts
    too); the weight-gradient form returns ``out_dtype`` (default: ``mat_a``'s)."""
    _check(mat_a, mat_b, offs, index, n_out)
    ends = _ends(offs)
    rows = mat_a.shape[0] if mat_b.dim() == 3 else mat_a.shape[1]
    if ends and ends[-1] != rows or any(b < a for a, b in zip([0, *ends], ends)):
        raise ValueError(f"overlapc::grouped_mm: offsets {ends} must rise to the {rows} rows")
    if mat_b.dim() == 3:  # rows by per-group weights
        out = mat_a.new_empty((mat_a.shape[0], mat_b.shape[-1]))
        start = 0
        for end, w in zip(ends, index if index is not None else range(len(ends))):
            torch.mm(mat_a[start:end], mat_b[w].to(mat_a.dtype), out=out[start:end])
            start = end
        return out
    # per-group sums over rows (weight gradients)
    starts, shape = [0, *ends[:-1]], (mat_a.shape[0], mat_b.shape[-1])
    dtype = out_dtype or mat_a.dtype
    if index is None:
        out = mat_a.new_empty((len(ends), *shape), dtype=dtype)
        for g, (start, end) in enumerate(zip(starts, ends)):
            if dtype == mat_a.dtype:
                torch.mm(mat_a[:, start:end], mat_b[start:end], out=out[g])
            else:
                out[g] = torch.mm(mat_a[:, start:end], mat_b[start:end])
        return out
    # Each group's product rounded to the dtype, then added, last group first: as eager's
    # autograd sums the gradient of a weight that several groups read (it reaches the
    # weight from the last group first). addmm_ would round once: 1 bf16 ulp off eager.
    out = mat_a.new_zeros((n_out, *shape), dtype=dtype)
    for g in reversed(range(len(ends))):
        out[index[g]] += torch.mm(mat_a[:, starts[g] : ends[g]], mat_b[starts[g] : ends[g]]).to(dtype)
    return out


@grouped_mm.register_fake
def _(mat_a, mat_b, offs, index=None, n_out=-1, out_dtype=None):
    _check(mat_a, mat_b, offs, index, n_out)
    if mat_b.dim() == 3:
        return mat_a.new_empty((mat_a.shape[0], mat_b.shape[-1]))
    n = n_out if index is not None else offs.shape[0]
    return mat_a.new_empty((n, mat_a.shape[0], mat_b.shape[-1]), dtype=out_dtype or mat_a.dtype)


def _check(a, b, offs, index, n_out):
    if offs.dim() != 1 or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"overlapc::grouped_mm: offs must be a 1-D int32/int64 tensor, got {offs.dtype} "
            f"of shape {tuple(offs.shape)}"
        )
    if a.dim() != 2 or b.dim() not in (2, 3):
        raise ValueError(
            f"overlapc::grouped_mm takes (R, K) x (G, K, N) or (K, R) x (R, N); got {tuple(a.shape)} x {tuple(b.shape)}"
        )
    torch._check(
        a.shape[1] == b.shape[-2],
        lambda: f"overlapc::grouped_mm: inner sizes differ: {tuple(a.shape)} x {tuple(b.shape)}",
    )
    if index is not None:
        n = b.shape[0] if b.dim() == 3 else n_out
        if len(index) != offs.shape[0] or not all(0 <= i < n for i in index):
            raise ValueError(
                f"overlapc::grouped_mm: index {list(index)} must give each of the {offs.shape[0]} "
                f"groups a weight in 0..{n - 1}"
            )
    elif b.dim() == 3:
        torch._check(
            b.shape[0] == offs.shape[0],
            lambda: f"overlapc::grouped_mm: {b.shape[0]} weights for {offs.shape[0]} groups",
        )


def _setup(ctx, inputs, output):
    a, b, offs, index, *_ = inputs
    ctx.index = index
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    if b.dim() != 3:
        raise RuntimeError(
            "overlapc::grouped_mm: the backward of its weight-gradient form "
            "((K, R) x (R, N)) is not implemented (double backward)"
        )
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = grouped_mm(grad, b.transpose(-2, -1), offs, ctx.index)
    if ctx.needs_input_grad[1]:
        grad_b = grouped_mm(a.t(), grad, offs, ctx.index, b.shape[0] if ctx.index is not None else -1, b.dtype)
    return grad_a, grad_b, None, None, None, None


grouped_mm.register_autograd(_backward, setup_context=_setup)
GROUPED_MM = torch.ops.overlapc.grouped_mm.default


def _autocast_kernel(device_type: str):
    """``mm``'s autocast rule for the op: inside an autocast region of ``device_type`` the rows
    (and, in the weight-gradient form, both operands) are cast to the autocast dtype if they
    are floating point but not float64; the 3-D weights are cast per group by the op itself,
    as the loop's ``mm`` cast each ``W[e_g]``. Runs the op with autocast off below it."""
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))

    def cast(t):
        dtype = torch.get_autocast_dtype(device_type)
        if (
            isinstance(t, torch.Tensor)
            and t.is_floating_point()
            and t.dtype not in (torch.float64, dtype)
            and t.device.type == device_type
        ):
            return t.to(dtype)
        return t

    def kernel(_keyset, mat_a, mat_b, offs, index=None, n_out=-1, out_dtype=None):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            if mat_b.dim() == 2:
                mat_b = cast(mat_b)
            return GROUPED_MM(cast(mat_a), mat_b, offs, index, n_out, out_dtype)

    return kernel


_LIB = torch.library.Library("overlapc", "FRAGMENT")  # noqa: TOR901 -- the op's autocast kernels
for _device in ("cpu", "cuda"):
    _LIB.impl(
        "grouped_mm",
        _autocast_kernel(_device),
        "Autocast" + torch._C._dispatch_key_for_device(_device),
        with_keyset=True,
    )
