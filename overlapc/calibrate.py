"""Measure this world's hardware profile: GEMM rates and link alpha/beta (a few seconds).

    overlapc calibrate --world-size 2 [--out FILE]      # spawns a local gloo world
    profile = overlapc.calibrate.measure(group)          # inside a running world, every rank

Every rank measures; rank 0's numbers are broadcast, so every rank plans with the same
profile (a rank that planned from other numbers would issue other collectives).

GEMM: square-ish ``mm`` of several sizes per dtype; the model's curve
``t = (F + F_half) / (peak * eff_max)`` is a straight line in F, fitted by least squares
(``peak * eff_max`` from the slope, ``F_half`` from the intercept; eff_max is 1 here:
"peak" is the best measured rate); times are first divided by the rows term
``1 + half_rows / M``, with half_rows from a line through the times of one 1024 x 2048
weight applied to 32 .. 512 rows (a chunk's GEMM streams the whole weight for its share of
the rows), for ``mm`` and for ``bmm`` (``half_rows_batched``, rows per batch entry).
Link: ``all_gather_into_tensor`` of several sizes;
``t = (W-1) * alpha + (W-1) * B / beta``: beta from the slope over the three largest. The reduce-scatter factor is the
measured ratio of a reduce-scatter to the ring formula (gloo runs it as an all-reduce);
a 32 MiB one's excess over that is ``rs_large``.
Overlap loss: an all-gather and a run of GEMMs of about the same duration started
together; the part of the shorter one that did not hide. Comm loss (per kind): an
all-gather, a reduce-scatter, each with GEMMs of half its time under it; how much longer
the transfer took per second of GEMM. Alpha: 16 tiny all-gathers
in a row; loaded latency: the same with GEMMs on a side thread, over alone; chunk
overhead: six tiny ops (the slices, views and concatenation parts a chunk adds). Copy
rate: a 64 MiB copy; first touch of fresh memory: a new 64 MiB tensor filled, over a kept one.
"""

from __future__ import annotations

import json
import threading
import time

import torch
import torch.distributed as dist

# torch 2.13 deprecates reduce_scatter_tensor and all_gather_into_tensor (a FutureWarning per
# call) for reduce_scatter_single and all_gather_single, same signatures; torch 2.11 has only
# the former.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

GEMM_SIZES = [(128, 256, 256), (256, 512, 512), (512, 1024, 1024), (1024, 1024, 1024)]
ROWS = ((32, 64, 128, 256, 512), 1024, 2048, 4)
"""(rows M, K, N, batch): one weight (``batch`` of them for bmm) applied to M rows, for the
rows term of the GEMM curve."""
COMM_BYTES = [1 << 12, 1 << 16, 1 << 19, 1 << 21, 1 << 22]
RS_BIG = 32 << 20  # input bytes of the large reduce-scatter (the excess over the rs_factor formula)
STREAM_BYTES = 8 << 20  # a curve point's back-to-back run moves at least this much (gathered / sent)


def median_seconds(fn, reps: int) -> float:
    """Median wall seconds of ``reps`` synchronous calls of ``fn``, after an untimed one."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]


def _local_rounds(fns, reps: int) -> list[float]:
    """Each of ``fns`` run once untimed, then timed once per round on this rank (no barrier),
    ``reps`` rounds: their typical times, in order."""
    for f in fns:
        f()
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            f()
            ts[i].append(time.perf_counter() - t)
    return [_typical(v) for v in ts]


def _rows_term(dtype, batched: bool, half_flops: float, reps: int) -> float:
    """Rows (per batch entry) at which a GEMM of one weight runs at half its rate: the times
    of ``ROWS``' M values, interleaved round by round, fitted as a line t = c (M + h) + c0,
    where c0 is the fixed cost ``half_flops`` already stands for. Per flop
    ``t ~ 1 + h / M`` (passes/cost.t_gemm); clamped to >= 0."""
    ms, k, n, b = ROWS
    lead = [b] if batched else []
    w = torch.randn(*lead, k, n, dtype=dtype)
    xs = [torch.randn(*lead, m, k, dtype=dtype) for m in ms]
    op = torch.bmm if batched else torch.mm
    icpt, slope = _fit(list(ms), _local_rounds([lambda x=x: op(x, w) for x in xs], reps))
    if slope <= 0:
        return 0.0
    return max(0.0, icpt / slope - half_flops / (2 * k * n * (b if batched else 1)))


FRESH_BYTES = 32 << 20
"""glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): a block at
least this big is mmap'd on every allocation and unmapped on free, so its first write
page-faults every time; smaller ones are reused from the heap once the threshold has risen."""


def _fresh_bw(reps: int) -> float:
    """Bytes/s of the first touch of a fresh ``2 * FRESH_BYTES`` allocation: filling a new
    tensor against filling a kept one, interleaved round by round."""
    n = 2 * FRESH_BYTES // 4
    kept = torch.empty(n)
    t_fresh, t_kept = _local_rounds([lambda: torch.empty(n).fill_(1.0), lambda: kept.fill_(1.0)], reps)
    extra = t_fresh - t_kept
    return 2 * FRESH_BYTES / extra if extra > 0 else 0.0


def _fit(xs, ys):
    """Least-squares line y = a + b x; returns (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _typical(ts: list) -> float:
    """The mean without the fastest and the slowest (from 5 values; else the median). Not the
    median: over a shaped TCP link a transfer's time is bimodal, and a median lands on either
    mode from one calibration to the next, where the steps pay the mix
    (docs/cost_model.md#measurements-behind-calibration)."""
    ts = sorted(ts)
    if len(ts) < 5:
        return ts[len(ts) // 2]
    return sum(ts[1:-1]) / (len(ts) - 2)


def _comm_time(fn, group, reps: int, warm: bool = True) -> float:
    """The typical (:func:`_typical`) time over reps of the slowest rank (barrier before each;
    with ``warm``, one untimed run first)."""
    ts = []
    for _ in range(reps + warm):
        dist.barrier(group)
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    t = torch.tensor([_typical(ts[warm:])], dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX, group)
    return float(t)


def _rounds(fns, group, reps: int) -> list[float]:
    """Each of ``fns`` timed once per round (slowest rank, barrier before each), ``reps``
    rounds: their typical times, in order. Round by round, so that drift and the other
    ranks' load hit all of them alike."""
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            ts[i].append(_comm_time(fn, group, 1, warm=False))
    return [_typical(v) for v in ts]


def _pair_loss(issue, a, b, reps_mm: int, group, reps: int) -> float:
    """(both - longer) / shorter for a transfer (``issue()`` returns its work) and ``reps_mm``
    GEMMs ``a @ b`` started together, each of the three timed in every round (slowest rank,
    barrier before each), typical times over ``reps`` rounds; clamped to [0, 1]."""

    def gemms():
        for _ in range(reps_mm):
            torch.mm(a, b)

    def both():
        work = issue()
        gemms()
        work.wait()

    both()
    t_c, t_g, t_both = _rounds((lambda: issue().wait(), gemms, both), group, reps)
    return min(1.0, max(0.0, (t_both - max(t_c, t_g)) / min(t_c, t_g)))


def _loaded_latency(seq, a, b, group, reps: int) -> float:
    """``seq()`` (a run of latency-bound collectives) timed alone and with GEMMs ``a @ b``
    running on a side thread of every rank, round by round (slowest rank, barrier before
    each): the ratio of the typical times, at least 1. A pipeline's chunks are on the wire
    while their rank computes; the baseline's collectives are not."""
    alone, loaded = [], []
    for _ in range(reps):
        alone.append(_comm_time(seq, group, 1, warm=False))
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                torch.mm(a, b)

        th = threading.Thread(target=spin, name="overlapc-calibrate-load", daemon=True)
        th.start()
        try:
            loaded.append(_comm_time(seq, group, 1, warm=False))
        finally:
            stop.set()
            th.join()
    return max(1.0, _typical(loaded) / _typical(alone))


def _concurrent_excess(issue, link: float, group, reps: int) -> float:
    """Two transfers (``issue()`` returns its work) issued at once against one after the
    other, timed round by round: the share of a transfer's time beyond ``link`` (its bytes at
    the link's best rate) that still shows when they run side by side; clamped to [0, 1]."""

    def seq():
        issue().wait()
        issue().wait()

    def together():
        a, b = issue(), issue()
        a.wait()
        b.wait()

    t_seq, t_tog = (t / 2 for t in _rounds((seq, together), group, reps))
    if t_seq - link <= 0.05 * t_seq:  # nothing beyond the link's rate to hide
        return 1.0
    return min(1.0, max(0.0, (t_tog - link) / (t_seq - link)))


def measure(group=None, dtypes=("float32", "bfloat16"), reps: int = 9, name: str = "cpu-local") -> dict:
    """This machine's and ``group``'s cost-model profile (every rank of ``group`` calls it; all
    get rank 0's numbers). The measurements run in a fixed order, each collective on every rank."""
    from overlapc.passes import ops

    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    gemm, points = {}, {}
    for dt in dtypes:
        gemm[dt], points[dt] = _measure_gemm(getattr(torch, dt), reps)
    link = _measure_link(group, world, reps)
    alpha, tiny_seqs = _measure_latency(group, world, reps)
    rs_factor, rs_large = _measure_reduce_scatter(link, alpha, group, world, reps)
    loss, comm_loss = _measure_overlap(link, group, world, reps)
    prof = {
        "name": name,
        "source": (
            f"measured by overlapc calibrate on {time.strftime('%Y-%m-%d %H:%M')} UTC, world {world}, "
            f"backend {dist.get_backend(group)}, {torch.get_num_threads()} torch thread(s): "
            f"mm of {GEMM_SIZES}; all_gather_into_tensor of {COMM_BYTES} B per rank, "
            f"all_to_all_single of {world} times those, reduce_scatter_tensor of {world} times "
            f"{COMM_BYTES[-2:]} B"
        ),
        "gemm": gemm,
        "link": {"alpha_us": alpha * 1e6, "beta_gbps": link["beta"] / 1e9},
        "overlap_loss": round(loss, 3),
        "comm_loss": {k: round(v, 3) for k, v in comm_loss.items()},
        "min_gain": 0.03,
        "concurrent_reductions": dist.get_backend(group) == "gloo",
        "comm_threads": ops.group_comm_threads(group.group_name) or 1,
        "concurrent_excess": round(_measure_concurrency(link, group, world, reps), 3),
        "loaded_latency": _measure_loaded_latency(tiny_seqs, group, reps),
        "rs_factor": rs_factor,
        "rs_large": rs_large,
        "fused_efficiency": None,
        "curves": link["curves"],
        "curves_world": world,
        "measured": {"mm_flops_s": points, "all_gather_bytes_s": [[x, round(y, 9)] for x, y in link["ring"]]},
        **_measure_local(reps),
    }
    obj = [prof]
    dist.broadcast_object_list(obj, src=dist.get_global_rank(group, 0), group=group)
    return obj[0]


def _measure_gemm(dtype, reps: int) -> tuple[dict, list]:
    """GEMM rate, fixed cost per call and rows term of one dtype; and the (flops, s) points.

    How the rate falls with the rows (M), as a chunk's GEMM streams the whole weight for a
    fraction of the rows: one weight applied to 32 .. 512 rows (mm; and bmm, as per-expert
    GEMMs are, where it shows more). A line through five sizes, interleaved, is steadier under
    timing noise than the ratio of two (docs/cost_model.md). half_flops (a fixed cost per call)
    comes from the square GEMMs' fit and is taken out of the rows term; then peak and
    half_flops are refitted without it."""
    flops, times = [], []
    for m, n, k in GEMM_SIZES:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        flops.append(2 * m * n * k)
        times.append(median_seconds(lambda: torch.mm(a, b), reps))

    def fit(half_rows):  # (rate, half_flops) of the times without the rows term
        icpt, slope = _fit(flops, [t / (1 + half_rows / m) for t, (m, _, _) in zip(times, GEMM_SIZES)])
        rate = 1 / slope if slope > 0 else max(f / t for f, t in zip(flops, times))
        return rate, max(0.0, icpt * rate)

    _, half = fit(0.0)
    half_rows = _rows_term(dtype, False, half, reps)
    half_rows_batched = _rows_term(dtype, True, half, reps)
    rate, half = fit(half_rows)
    return {
        "peak_tflops": rate / 1e12,
        "eff_max": 1.0,
        "half_gflop": half / 1e9,
        "half_rows": round(half_rows, 1),
        "half_rows_batched": round(half_rows_batched, 1),
    }, [[f, round(t, 9)] for f, t in zip(flops, times)]


def _measure_link(group, world: int, reps: int) -> dict:
    """All-gather and all-to-all curves (bytes of one rank's input -> s), the ring points and
    bandwidth, and reduce-scatter times at the two largest sizes.

    The model reads the curves where it has numbers: a link's rate per byte need not be
    constant (over TCP on a shaped veth a 16 MiB all-to-all runs at 52-66% of the rate 2 MiB
    ones reach, so chunks can be faster per byte than the whole). Each point is the time per
    message of a back-to-back run of at least STREAM_BYTES: a lone small message rides a
    token-bucket shaper's burst and looks faster than the link, which a pipeline's chunks,
    sent one after another, are not."""
    ring, rs_times = [], []
    curves = {"all_gather": [], "all_to_all": []}
    for nbytes in COMM_BYTES:
        x = torch.empty(nbytes // 4, dtype=torch.float32)
        out = torch.empty(world * x.numel(), dtype=torch.float32)
        out2 = torch.empty_like(out)
        ring.append(((world - 1) * nbytes, _comm_time(lambda: _all_gather(out, x, group=group), group, reps)))
        k = min(32, max(1, -(-STREAM_BYTES // (world * nbytes))))  # tiny ones: latency, not the burst

        def stream(op, k=k):
            for _ in range(k):
                op()

        n = reps if k > 1 else 3 * reps  # one message per run (the largest): bimodal times, more runs
        t_ag = _comm_time(lambda: stream(lambda: _all_gather(out, x, group=group)), group, n)
        t_a2a = _comm_time(lambda: stream(lambda: dist.all_to_all_single(out2, out, group=group)), group, n)
        curves["all_gather"].append([nbytes, round(t_ag / k, 9)])
        curves["all_to_all"].append([world * nbytes, round(t_a2a / k, 9)])
        if nbytes in COMM_BYTES[-2:]:  # the reduce-scatter factor is taken from the largest two
            rs_times.append((_comm_time(lambda: _reduce_scatter(x, out, group=group), group, reps), world * nbytes))
    # Bandwidth from the large transfers (a least-squares intercept over all sizes would be
    # dominated by the large ones and is often negative: latency is measured on its own).
    xs, ys = zip(*ring)
    _, slope = _fit(xs[-3:], ys[-3:])
    beta = 1 / slope if slope > 0 else max(x / y for x, y in ring)
    return {"ring": ring, "beta": beta, "curves": curves, "rs_times": rs_times}


def _measure_latency(group, world: int, reps: int):
    """Alpha, the mean latency per ring step of 16 tiny all-gathers in a row, each waited on
    (as a chunked pipeline issues them on gloo); and the two tiny sequences (all-gathers,
    reduce-scatters) that the loaded latency is measured with. One lone message is too noisy,
    and chunks of real sizes ride the shaper's burst bucket, which hides latency that a
    pipeline's chunks, spread out in time, do pay."""
    tiny_in, tiny_out, tiny_rs = torch.empty(16), torch.empty(16 * world), torch.empty(16)

    def tiny_seq():
        for _ in range(16):
            _all_gather(tiny_out, tiny_in, group=group)

    def tiny_rs_seq():
        for _ in range(16):
            _reduce_scatter(tiny_rs, tiny_out, group=group)

    alpha = max(_comm_time(tiny_seq, group, reps) / (16 * max(world - 1, 1)), 1e-6)
    return alpha, {"all_gather": tiny_seq, "reduce_scatter": tiny_rs_seq}


def _measure_loaded_latency(tiny_seqs: dict, group, reps: int) -> dict:
    """How much longer latency is with GEMMs (~1 ms ones) running on the rank, per kind
    (1.0-2.3 on the emulated cluster, larger with more ranks and faster links:
    docs/cost_model.md#measurements-behind-calibration)."""
    a, b = torch.randn(256, 512), torch.randn(512, 512)
    return {kind: round(_loaded_latency(seq, a, b, group, 2 * reps), 2) for kind, seq in tiny_seqs.items()}


def _measure_reduce_scatter(link: dict, alpha: float, group, world: int, reps: int):
    """rs_factor, reduce-scatter time over the ring formula's; and rs_large, the excess of a
    large one (RS_BIG input bytes: 1.1-1.6x the factor's time on the emulated cluster), priced
    from the largest fitted size up (chunks, smaller, are not affected). Reduce-scatters keep
    alpha-beta times rs_factor: priced by their own curve, chunked ones (issued at once, two
    at a time on gloo's threads) came out up to 58% too cheap on bench_plan's timings
    (alpha-beta: at most 16%)."""

    def ring(b):
        return (world - 1) * alpha + (world - 1) / world * b / link["beta"]

    rs = [t / ring(b) for t, b in link["rs_times"]]
    rs_factor = round(sum(rs) / len(rs), 2)
    x_big, in_big = torch.empty(RS_BIG // 4 // world), torch.empty(RS_BIG // 4)
    t_big = _comm_time(lambda: _reduce_scatter(x_big, in_big, group=group), group, max(3, reps // 2))
    b_fit = max(b for _, b in link["rs_times"])
    return rs_factor, [[b_fit, 0.0], [RS_BIG, round(max(0.0, t_big - rs_factor * ring(RS_BIG)), 9)]]


def _measure_overlap(link: dict, group, world: int, reps: int):
    """overlap_loss: an all-gather and GEMMs of about the same duration; the part of the
    shorter that did not hide. comm_loss: an all-gather, and a reduce-scatter of the same
    output, each with GEMMs of about half its time under it; how much the transfer was
    lengthened per second of GEMM. Near 0 where the link is the bottleneck, up to 1 where moving
    bytes is CPU work that the GEMMs take cores from. Each is taken from three timings
    interleaved round by round (transfer alone, GEMMs alone, both), so that drift and the
    other ranks' load hit all three alike (docs/cost_model.md#measurements-behind-calibration)."""
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    t_mm = median_seconds(lambda: torch.mm(a, b), reps)
    big = torch.empty(COMM_BYTES[-1] // 4)
    big_out, rs_in = torch.empty(world * big.numel()), torch.empty(world * big.numel())

    def ag():
        return _all_gather(big_out, big, group=group, async_op=True)

    def rs_op():
        return _reduce_scatter(big, rs_in, group=group, async_op=True)

    t_ag, t_rs = link["ring"][-1][1], link["rs_times"][-1][0]
    loss = _pair_loss(ag, a, b, max(1, round(t_ag / t_mm)), group, reps)
    return loss, {
        "all_gather": _pair_loss(ag, a, b, max(1, round(0.5 * t_ag / t_mm)), group, reps),
        "reduce_scatter": _pair_loss(rs_op, a, b, max(1, round(0.5 * t_rs / t_mm)), group, reps),
    }


def _measure_concurrency(link: dict, group, world: int, reps: int) -> float:
    """Several all-to-alls of one chunk issued at once (Ulysses' q, k, v) run side by side on
    gloo's threads: a big one's time beyond the link's rate (one TCP connection does not fill
    a shaped link) partly hides (docs/cost_model.md#measurements-behind-calibration)."""
    a2a_in, a2a_out = torch.empty(world * COMM_BYTES[-1] // 4), torch.empty(world * COMM_BYTES[-1] // 4)
    a2a_rate = min(t / b for b, t in link["curves"]["all_to_all"])
    return _concurrent_excess(
        lambda: dist.all_to_all_single(a2a_out, a2a_in, group=group, async_op=True),
        a2a_rate * world * COMM_BYTES[-1],
        group,
        reps,
    )


def _measure_local(reps: int) -> dict:
    """This rank's own costs: the few small ops a chunk adds (slice, view, cat part), the copy
    rate (read + write of 64 MiB counted once, for concatenations), and the rate of outputs of
    FRESH_BYTES and more, which page-fault on every call (whole GEMMs of big sites run below
    the rate fitted on small ones; their chunks do not pay it)."""
    tiny = torch.randn(8, 8)
    src = torch.empty(1 << 24, dtype=torch.float32)
    dst = torch.empty_like(src)
    fresh_bw = _fresh_bw(reps)
    return {
        "chunk_overhead_us": 6 * median_seconds(lambda: torch.mm(tiny, tiny), reps) * 1e6,
        "copy_gbps": src.numel() * 4 / median_seconds(lambda: dst.copy_(src), reps) / 1e9,
        "fresh_alloc": {"bytes": FRESH_BYTES, "gbps": round(fresh_bw / 1e9, 3)} if fresh_bw else None,
    }


def calibrate_job(threads: int = 1):
    torch.set_num_threads(threads)
    return measure()


def main_launched(out: str | None) -> str | None:
    """Calibrate the world this process was launched into (torchrun sets RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT): every rank measures, rank 0 writes the profile (default: the
    cpu-local profile) and returns its path; the others return None once it is written.
    Pass ``hardware=FILE`` with that path (on a filesystem every rank reads) to plan with it."""
    from pathlib import Path

    from overlapc.passes.cost import CACHE_DIR

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo")  # the profile is of CPU ranks over gloo (the GPU profiles are by name)
    try:
        prof = measure()
        path = Path(out) if out else CACHE_DIR / "cpu-local.json"
        if dist.get_rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(prof, indent=1))
        dist.barrier()
        return str(path) if dist.get_rank() == 0 else None
    finally:
        if owned:
            dist.destroy_process_group()


def main(world_size: int, out: str | None, threads: int = 1) -> str:
    from pathlib import Path

    from overlapc.passes.cost import CACHE_DIR

    from .testing.world import World

    with World(world_size, timeout=300, threads=threads) as w:
        prof = w.run(calibrate_job, threads)[0]
    path = Path(out) if out else CACHE_DIR / "cpu-local.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prof, indent=1))
    return str(path)
