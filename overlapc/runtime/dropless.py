"""Run-time pipeline for all-to-alls whose split sizes are known only at run time.

The dropless MoE form exchanges split sizes at run time (``.tolist()`` of an exchanged
count tensor) and moves an uneven number of rows to every peer::

    recv = all_to_all(xs, out_splits, in_splits)       # rows grouped by source rank
    out  = body(recv)                                   # row-wise: expert GEMMs per group
    back = all_to_all(out, in_splits, out_splits)       # rows go home

Chunk boundaries cannot be compiled in, so the pass (passes/dropless.py) replaces the three
with one call to :class:`DroplessPipeline`, which decides them when the splits are known:
chunk ``c`` of the block exchanged with rank ``r`` is rows ``[b(n_r, c), b(n_r, c + 1))``
of that block, where ``b`` depends only on the block's size ``n_r`` and the chunk count,
so sender and receiver agree without exchanging anything. Then::

    issue dispatch chunk 0 (async)
    for c: wait dispatch c; issue dispatch c + 1; body(rows of chunk c); issue combine c
    tail(whole rows): the weight gradients, under the last combines
    wait combines; put the returned rows where they belong

``body`` is the graph between the two all-to-alls, replayed per chunk. It is row-wise:
every output row depends only on the same input row (pointwise ops, ``mm`` by a weight,
grouped ``_grouped_mm`` by a weight, where the groups are given by ``offs``). Reductions
over rows (weight gradients: ``_grouped_mm(t(a), b, offs)``, ``mm(t(a), b)``) are the
*tail*: run once, after the last combine chunk is issued and before the combines are
waited on, on their row operands whole (reassembled from the chunks). A group (an
expert's rows from one source) may be cut by a chunk boundary; each chunk's ``offs``
counts the rows of every group that fall into it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.fx import GraphModule

log = logging.getLogger("overlapc")


def boundaries(n: int, weights: list[int]) -> list[int]:
    """Chunk boundaries 0 = b_0 <= ... <= b_C = n of ``n`` rows by ``weights``; chunks may be
    empty. A pure function of (n, weights): both ends of a transfer compute the same."""
    total, acc, out = sum(weights), 0, [0]
    for w in weights:
        acc += w
        out.append(n * acc // total)
    return out


def chunk_weights(chunks: int) -> list[int]:
    """Weights 1, 2, ..., 2, 1 (3 chunks or more): the first and last chunk, which the
    pipeline cannot hide, are half the size of the others (as passes/build.chunk_sizes)."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    return [1] + [2] * (chunks - 2) + [1] if chunks >= 3 else [1] * chunks


@dataclass(eq=False)
class DroplessPipeline:
    """A callable graph node: ``(xs, in_splits, out_splits, offs, row_inputs, consts) ->
    [back, *row_outputs, *reduced_outputs]``.

    body: GraphModule ``(recv, offs, *row_inputs, *consts) -> (combine_input, *row_outputs,
    *tail rows)``; row inputs are tensors aligned with ``recv``'s rows that come from
    elsewhere (activations saved by the forward graph); consts are used whole (weights).
    tail: GraphModule ``(*tail rows whole, offs, *tail consts) -> reduced_outputs`` or None;
    ``tail_sources[i]`` says where its i-th input comes from: ("input", j) row input j,
    ("row_output", j) row output j, ("body", k) the body's k-th extra output.
    """

    body: GraphModule
    group_name: str
    chunks: int
    n_row_inputs: int
    n_row_outputs: int
    tail: GraphModule | None = None
    tail_sources: list = None
    n_tail_consts: int = 0
    """The last ``n_tail_consts`` consts are the tail's (after the tail rows and offs), not the body's."""
    site: str = ""
    out_shapes: list = None
    """Per output: ("sent" | "received" | None, trailing shape, dtype): rows = rows sent,
    rows received, or a fixed shape. For the custom op's fake implementation."""
    compile_body: bool = False
    """Compile ``body`` with inductor (``dynamic=True``: one compile serves every chunk size)
    at its first run. Set for pipelines in inductor's graphs, whose body is the graph after
    inductor's decompositions: replayed op by op it runs unfused (SiLU as ``exp`` and
    friends, dtype conversions as prims calls), while the baseline's compiled kernels fuse
    it. On the benchmark's MoE layer (emulated cluster, training step): E 0.71 -> 1.04 at
    world 2, 0.42 -> 0.50 at world 4 (BENCHMARKS.md)."""
    _body_fn = None

    # FX names call_function nodes and their globals after these.
    __name__ = "overlapc_dropless_pipeline"

    def __post_init__(self):
        self.__qualname__ = self.__name__

    calls = 0
    """Pipelines run in this process (all instances): lets tests see the rewrite really ran."""
    compiled_bodies = 0
    """Bodies compiled in this process (all instances), for tests."""

    def _run_body(self, *args):
        """``body(*args)``, compiled where ``compile_body`` says so. A compile that fails (an
        op inductor cannot lower, say) is logged and the body runs uncompiled from then on:
        the body is functional, so running it again is safe."""
        if self._body_fn is None:
            if self.compile_body:
                self._body_fn = torch.compile(self.body, dynamic=True)
                DroplessPipeline.compiled_bodies += 1
            else:
                self._body_fn = self.body
        if self._body_fn is self.body:
            return self.body(*args)
        try:
            return self._body_fn(*args)
        except Exception as e:  # noqa: BLE001 -- any compile failure; a real error recurs below
            log.warning(
                "overlapc: dropless pipeline %s: its compiled body failed (%s: %s); it runs uncompiled",
                self.site,
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            self._body_fn = self.body
            return self.body(*args)

    def __call__(self, xs, in_splits, out_splits, offs, row_inputs, consts):
        from torch.distributed.distributed_c10d import _resolve_process_group

        DroplessPipeline.calls += 1

        group = _resolve_process_group(self.group_name)
        in_splits, out_splits = [int(s) for s in in_splits], [int(s) for s in out_splits]
        if sum(in_splits) != xs.shape[0]:
            raise RuntimeError(
                f"overlapc: dropless pipeline {self.site}: input splits {in_splits} "
                f"do not add up to the {xs.shape[0]} rows sent"
            )
        w = chunk_weights(self.chunks)
        b_in = [boundaries(n, w) for n in in_splits]  # my rows, per destination block
        b_out = [boundaries(n, w) for n in out_splits]  # rows I receive, per source block
        start_in, start_out = _starts(in_splits), _starts(out_splits)
        total_out = sum(out_splits)
        group_ends = None
        if offs is not None:
            group_ends = offs.to(torch.int64)
            if group_ends.numel() and int(group_ends[-1]) != total_out:
                raise RuntimeError(
                    f"overlapc: dropless pipeline {self.site}: the grouped matmul's offsets end at "
                    f"{int(group_ends[-1])}, but {total_out} rows were received"
                )
        xs = xs.contiguous()
        split = len(consts) - self.n_tail_consts
        consts, tail_consts = consts[:split], consts[split:]

        # Dispatch: chunk c + 1 is issued once chunk c has arrived, not all at once: chunks
        # in flight together share the link and the first arrives late (passes/all_to_all.
        # _one_at_a_time has the measurements).
        def dispatch(c):
            send_sizes = [b[c + 1] - b[c] for b in b_in]
            recv_sizes = [b[c + 1] - b[c] for b in b_out]
            send = torch.cat([xs[s + b[c] : s + b[c + 1]] for s, b in zip(start_in, b_in)])
            recv = xs.new_empty((sum(recv_sizes), *xs.shape[1:]))
            work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group, async_op=True)
            return work, recv, send_sizes, recv_sizes

        sources = self.tail_sources or []
        n_extra = sum(1 for kind, _ in sources if kind == "body")
        row_parts: list[list[torch.Tensor]] = [[] for _ in range(self.n_row_outputs + n_extra)]
        combined = []
        nxt = dispatch(0)
        for c in range(self.chunks):
            work, recv, send_sizes, recv_sizes = nxt
            offs_c = None
            if group_ends is not None:
                offs_c = _chunk_offsets(group_ends, start_out, b_out, c).to(offs.dtype)
            row_in = [_take(t, start_out, b_out, c) for t in row_inputs]
            work.wait()
            if c + 1 < self.chunks:
                nxt = dispatch(c + 1)
            outs = self._run_body(recv, offs_c, *row_in, *consts)
            out = outs[0].contiguous()
            back = out.new_empty((sum(send_sizes), *out.shape[1:]))
            cw = dist.all_to_all_single(back, out, send_sizes, recv_sizes, group=group, async_op=True)
            combined.append((cw, back))
            for i, part in enumerate(outs[1:]):
                row_parts[i].append(part)

        # While the last combines are on the wire: the whole rows, and the tail on them.
        wholes = [_place(parts, start_out, b_out, total_out) for parts in row_parts]
        row_outputs, extra = wholes[: self.n_row_outputs], wholes[self.n_row_outputs :]
        reduced_out = []
        if self.tail is not None:
            pick = {"input": row_inputs, "row_output": row_outputs, "body": extra}
            reduced_out = list(self.tail(*[pick[kind][i] for kind, i in sources], offs, *tail_consts))

        # Rows come home: chunk c of my block for rank r is rows [b(c), b(c+1)) of that block.
        backs = []
        for _c, (cw, back) in enumerate(combined):
            cw.wait()
            backs.append(back)
        result = _place(backs, start_in, b_in, xs.shape[0])
        return [result, *row_outputs, *reduced_out]


def _starts(splits: list[int]) -> list[int]:
    out, acc = [], 0
    for s in splits:
        out.append(acc)
        acc += s
    return out


def _take(t: torch.Tensor, starts, bounds, c) -> torch.Tensor:
    """The rows of chunk ``c`` of ``t`` (aligned with the received buffer), in chunk order:
    one contiguous range per source block. (Put back by :func:`_place`, slice by slice: an
    index_copy_ of the same rows took 2.5x as long, bf16 rows of 1024-2048, one thread.)"""
    parts = [t[s + b[c] : s + b[c + 1]] for s, b in zip(starts, bounds)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _chunk_offsets(group_ends: torch.Tensor, starts, bounds, c) -> torch.Tensor:
    """Cumulative row counts per group within chunk ``c``: chunk ``c`` takes from every
    source block ``r`` the range [s_r + b_r(c), s_r + b_r(c+1)) of the received rows; a group
    [e_{g-1}, e_g) contributes its overlap with each range. Groups stay in order."""
    ends = group_ends
    begins = torch.cat([ends.new_zeros(1), ends[:-1]])
    count = torch.zeros_like(ends)
    for s, b in zip(starts, bounds):
        lo, hi = s + b[c], s + b[c + 1]
        count += torch.clamp(
            torch.minimum(ends, ends.new_tensor(hi)) - torch.maximum(begins, begins.new_tensor(lo)), min=0
        )
    return torch.cumsum(count, 0)


def _place(parts, starts, bounds, n_rows) -> torch.Tensor:
    """Inverse of the chunking: chunk c holds, per block r, rows [b_r(c), b_r(c+1)) of it."""
    if not parts:
        raise ValueError("no chunks")
    out = parts[0].new_empty((n_rows, *parts[0].shape[1:]))
    for c, part in enumerate(parts):
        off = 0
        for s, b in zip(starts, bounds):
            n = b[c + 1] - b[c]
            out[s + b[c] : s + b[c + 1]] = part[off : off + n]
            off += n
    return out


# ----------------------------------------------------------------------------- custom op

_PIPELINES: dict[int, DroplessPipeline] = {}
"""Pipelines of this process by key: the graph holds the key, an int inductor can carry."""


def register(pipeline: DroplessPipeline) -> int:
    key = len(_PIPELINES)
    _PIPELINES[key] = pipeline
    return key


def pipelines_of(graph) -> list[DroplessPipeline]:
    """The pipelines a graph calls (through the custom op)."""
    return [
        _lookup(n.args[0])
        for n in graph.nodes
        if n.op == "call_function" and n.target is torch.ops.overlapc.dropless_pipeline.default
    ]


def _lookup(key: int) -> DroplessPipeline:
    try:
        return _PIPELINES[key]
    except KeyError:
        raise RuntimeError(
            f"overlapc: dropless pipeline #{key} is not registered in this process "
            "(a graph compiled by another process, e.g. loaded from a cache?)"
        ) from None


@torch.library.custom_op("overlapc::dropless_pipeline", mutates_args=())
def dropless_pipeline(
    key: int,
    xs: torch.Tensor,
    in_splits: list[int],
    out_splits: list[int],
    offs: torch.Tensor | None,
    row_inputs: list[torch.Tensor],
    consts: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Dispatch, body per chunk, combine: see :class:`DroplessPipeline`."""
    return _lookup(key)(xs, in_splits, out_splits, offs, row_inputs, consts)


@dropless_pipeline.register_fake
def _(key, xs, in_splits, out_splits, offs, row_inputs, consts):
    p = _lookup(key)
    sent, received = sum(in_splits), sum(out_splits)
    outs = []
    for rows, tail, dtype in p.out_shapes:
        n = sent if rows == "sent" else received if rows == "received" else None
        shape = (n, *tail) if n is not None else tuple(tail)
        outs.append(xs.new_empty(shape, dtype=dtype))
    return outs
