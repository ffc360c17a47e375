"""The fused Triton kernels on one device, peers emulated as separate buffers: the setups that
tests/gpu/checks.py checks and benchmarks/bench_fused_rates.py times.

- ``AllGatherGemm``: the AllGather+GEMM consumer (``ag_gemm_consumer``) over a gathered
  buffer of ``world`` shards; ``produce`` fills it chunk by chunk, each chunk followed by its
  flag, stored as the op stores them (``symm.store_word``: a pinned copy on a GPU).
- ``GemmReduceScatter``: rank 0's GEMM+ReduceScatter producer (``gemm_rs_producer``) writing
  its tiles into ``world`` owner buffers (pointer tables), and rank 0's consumer
  (``rs_reduce_consumer``) reducing them with the other sources' partials already in place.
- ``Pipelined``: the AG consumer while the producer runs on a side stream (on the CPU: in a
  thread, the consumer under the interpreter in this one), under the op's watchdog.

A kernel that never returns wedges the GPU context: nothing after it could run. Every wait on
the device here has a deadline (``device_done``, ``deadline``, ``join``); past it the process
prints every thread's stack and exits with status 3, so the caller's next process still runs.
"""

from __future__ import annotations

import threading

import torch

WORLD = 8  # emulated ranks: one node of 8 GPUs
LLM_SHAPES = [(8192, 8192, 1024), (8192, 8192, 3584), (16384, 8192, 1024), (8192, 3584, 8192)]
"""(M, K, N), M = the gathered rows: Llama-style column-parallel (N = 8192/8, 28672/8) and
row-parallel shapes, bf16."""
SMOKE_SHAPES = [(64, 48, 40)]
"""Tiny and not a multiple of any block size (the tiles' masks run), for the interpreter."""


# ---------------------------------------------------------------------- hang guards


def fail_exit(what: str) -> None:
    """Report what never finished, with every thread's stack, and end the process."""
    import faulthandler
    import os
    import sys

    print(f"FAIL {what}", flush=True)
    faulthandler.dump_traceback(sys.stdout, all_threads=True)
    sys.stdout.flush()
    os._exit(3)


def device_done(what: str, seconds: float) -> None:
    """Wait for the device to finish, at most ``seconds``, else ``fail_exit``."""
    if not torch.cuda.is_available():
        return
    waiter = threading.Thread(target=torch.cuda.synchronize, daemon=True)
    waiter.start()
    waiter.join(seconds)
    if waiter.is_alive():
        fail_exit(f"{what}: the device did not finish in {seconds:.0f} s")


class deadline:
    """Context: ``fail_exit`` if the block (which may wait on the device inside a library,
    e.g. ``do_bench``'s own synchronize) has not ended after ``seconds``."""

    def __init__(self, what: str, seconds: float):
        self._t = threading.Timer(seconds, fail_exit, args=(f"{what}: not done after {seconds:.0f} s",))
        self._t.daemon = True

    def __enter__(self):
        self._t.start()

    def __exit__(self, *exc):
        self._t.cancel()


def join(th: threading.Thread, what: str, seconds: float) -> None:
    th.join(seconds)
    if th.is_alive():
        fail_exit(f"{what}: the producer thread did not finish in {seconds:.0f} s")


def env(dev) -> dict:
    """The device and the versions a run used, for its record."""
    import platform

    import triton

    return dict(
        device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
    )


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.float() - ref.float()).abs().max().item()


def config_name(c: dict) -> str:
    return f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}"


# ---------------------------------------------------------------------- AllGather + GEMM


class AllGatherGemm:
    """``cat(shards) @ b`` by the AG consumer: ``world`` shards of ``M_L`` rows, gathered
    into one buffer in ``chunks`` chunks per shard, each with its flag."""

    def __init__(self, M_L: int, K: int, N: int, world: int, dtype: torch.dtype, dev, chunks: int = 4):
        self.M_L, self.K, self.N, self.world, self.chunks = M_L, K, N, world, chunks
        self.shards = [torch.randn(M_L, K, dtype=dtype, device=dev) / K**0.25 for _ in range(world)]
        self.b = torch.randn(K, N, dtype=dtype, device=dev) / K**0.25
        self.buf = torch.empty(world * M_L, K, dtype=dtype, device=dev)
        self.flags = torch.zeros(world * chunks, dtype=torch.int32, device=dev)
        self.abort = torch.zeros(1, dtype=torch.int32, device=dev)
        self.out = torch.empty(world * M_L, N, dtype=dtype, device=dev)
        self.chunk_rows = -(-M_L // chunks)
        self.precision = "ieee" if dtype == torch.float32 else "tf32"
        self.epoch = 0  # flags at this value are up
        self.flops = 2 * world * M_L * K * N
        self.shape = dict(M=world * M_L, K=K, N=N, world=world)

    def configs(self) -> list[dict]:
        from overlapc.kernels.gemm import configs

        return configs(self.world * self.M_L, self.N, self.K)

    def reference(self) -> torch.Tensor:
        return torch.cat(self.shards) @ self.b

    def launch(self, cfg: dict) -> None:
        """The consumer at the current epoch (it waits until those flags are up)."""
        from overlapc.kernels import INTERPRET
        from overlapc.kernels.gemm import ag_gemm_consumer

        M, N = self.world * self.M_L, self.N
        grid = (-(-M // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"]),)
        ag_gemm_consumer[grid](
            self.buf,
            self.b,
            self.out,
            self.flags,
            self.abort,
            self.M_L,
            N,
            self.K,
            self.world,
            0,
            self.chunks,
            self.chunk_rows,
            self.M_L,
            self.epoch,
            self.b.stride(0),
            self.b.stride(1),
            self.out.stride(0),
            self.out.stride(1),
            UPCAST=INTERPRET,
            PRECISION=self.precision,
            **cfg,
        )

    def produce(self) -> None:
        """Device-to-device copies of every shard, chunk by chunk, each followed by its flag."""
        from overlapc.runtime.symm import store_word

        for c in range(self.chunks):
            r0, r1 = c * self.chunk_rows, min(self.M_L, (c + 1) * self.chunk_rows)
            for src in range(self.world):
                self.buf[src * self.M_L + r0 : src * self.M_L + r1].copy_(self.shards[src][r0:r1])
                f = src * self.chunks + c
                store_word(self.flags[f : f + 1], self.epoch)

    def fill(self) -> None:
        """Data in place and every flag up, at a new epoch: the consumer is the GEMM alone."""
        self.epoch += 1
        self.produce()


class _AbortWord:
    """What ``fused.Watchdog`` raises: the emulated rank's abort word, stored as the op
    stores it (on its own stream on a GPU, so it lands while the consumer spins)."""

    def __init__(self, word: torch.Tensor):
        self.word = word
        self.stream = torch.cuda.Stream() if word.device.type == "cuda" else None

    def abort(self) -> None:
        from overlapc.runtime.symm import store_word

        if self.stream is None:
            store_word(self.word, 1)
            return
        with torch.cuda.stream(self.stream):
            store_word(self.word, 1)


class Pipelined:
    """Calls of the AG consumer while ``ag.produce`` fills the gathered buffer at the same
    time, under one watchdog (``overlapc.runtime.fused.Watchdog``) that raises the abort word
    after ``patience`` seconds, as the op's does: a consumer that starves its producer ends
    instead of hanging, and ``starved`` says so. Use as a context; each call is one epoch."""

    def __init__(self, ag: AllGatherGemm, cfg: dict, patience: float = 20.0):
        self.ag, self.cfg, self.patience = ag, cfg, patience
        self.cuda = ag.buf.device.type == "cuda"
        self.side = torch.cuda.Stream() if self.cuda else None
        self._dog = None

    def __enter__(self) -> Pipelined:
        from overlapc.runtime.fused import Watchdog

        self._dog = Watchdog(_AbortWord(self.ag.abort), self.patience)
        return self

    def __exit__(self, *exc) -> None:
        self._dog.stop()

    @property
    def starved(self) -> bool:
        return self._dog.fired

    def __call__(self) -> None:
        ag = self.ag
        ag.epoch += 1
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                ag.produce()
            ag.launch(self.cfg)
            torch.cuda.current_stream().wait_stream(self.side)
        else:
            th = threading.Thread(target=ag.produce, daemon=True)
            th.start()
            ag.launch(self.cfg)
            join(th, "ag_gemm producer", 60)


# ---------------------------------------------------------------------- GEMM + ReduceScatter


class GemmReduceScatter:
    """Rank 0 of ``reduce_scatter(a @ b)`` over ``world`` emulated ranks: its producer writes
    owner ``w``'s rows of ``a @ b`` into slot 0 of owner ``w``'s buffer; its consumer sums the
    ``world`` slots of its own buffer."""

    def __init__(self, M: int, K: int, N: int, world: int, dtype: torch.dtype, dev):
        self.M, self.K, self.N, self.world, self.dtype, self.dev = M, K, N, world, dtype, dev
        self.M_O = M // world
        self.a = torch.randn(M, K, dtype=dtype, device=dev) / K**0.25
        self.b = torch.randn(K, N, dtype=dtype, device=dev) / K**0.25
        self.owners = [torch.zeros(world * self.M_O, N, dtype=dtype, device=dev) for _ in range(world)]
        self.buf_table = torch.tensor([o.data_ptr() for o in self.owners], dtype=torch.int64, device=dev)
        self.out = torch.empty(self.M_O, N, dtype=dtype, device=dev)
        self.abort = torch.zeros(1, dtype=torch.int32, device=dev)
        self.precision = "ieee" if dtype == torch.float32 else "tf32"
        self.flops = 2 * M * K * N
        self.shape = dict(M=M, K=K, N=N, world=world)

    def configs(self) -> list[dict]:
        from overlapc.kernels.gemm import configs

        return configs(self.M_O, self.N, self.K)

    def tiles(self, cfg: dict) -> int:
        return -(-self.M_O // cfg["BLOCK_M"]) * -(-self.N // cfg["BLOCK_N"])

    def producer(self, cfg: dict):
        """(launch, signal pads): a launch of the producer, raising flags (epoch 1) in fresh
        signal pads, one per owner, which the launch keeps alive (the pointer table does not)."""
        from overlapc.kernels import INTERPRET, tl_dtype
        from overlapc.kernels.gemm import gemm_rs_producer

        world, tiles = self.world, self.tiles(cfg)
        sigs = [torch.zeros(world * tiles, dtype=torch.int32, device=self.dev) for _ in range(world)]
        sig_table = torch.tensor([s.data_ptr() for s in sigs], dtype=torch.int64, device=self.dev)
        a, b = self.a, self.b

        def launch(keep=sigs):
            gemm_rs_producer[(world * tiles,)](
                a,
                b,
                self.buf_table,
                sig_table,
                self.M_O,
                self.N,
                self.K,
                world,
                0,
                self.M_O,
                1,
                a.stride(0),
                a.stride(1),
                b.stride(0),
                b.stride(1),
                UPCAST=INTERPRET,
                PRECISION=self.precision,
                OUT_DTYPE=tl_dtype(self.dtype),
                **cfg,
            )

        return launch, sigs

    def reduce(self, cfg: dict) -> dict:
        """Producer then consumer, the other sources' partials of rank 0's rows already in
        place with their flags up. Returns the largest errors of rank 0's reduced rows and
        of every owner's slot 0, against fp32 references."""
        from overlapc.kernels import INTERPRET
        from overlapc.kernels.gemm import rs_reduce_consumer

        world, M_O = self.world, self.M_O
        for o in self.owners:  # earlier launches wrote every slot: this one starts clean
            o.zero_()
        self.out.zero_()
        launch, sigs = self.producer(cfg)
        tiles = self.tiles(cfg)
        partials = []
        for src in range(1, world):
            p = torch.randn(M_O, self.N, dtype=self.dtype, device=self.dev)
            self.owners[0][src * M_O : (src + 1) * M_O].copy_(p)
            sigs[0][src * tiles : (src + 1) * tiles].fill_(1)
            partials.append(p)
        launch()
        rs_reduce_consumer[(tiles,)](
            self.owners[0],
            self.out,
            sigs[0],
            self.abort,
            M_O,
            self.N,
            world,
            1,
            self.out.stride(0),
            self.out.stride(1),
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            GROUP_M=cfg["GROUP_M"],
            UPCAST=INTERPRET,
        )
        device_done(f"rs_reduce_consumer {M_O}x{self.N} with every flag already up", 30)
        full = self.a.float() @ self.b.float()
        # Rank 0 owns rows [0, M_O) of the scatter (dim 0): its own partial plus the others'.
        ref = full[:M_O] + sum(p.float() for p in partials)
        slots = max(max_err(o[:M_O], full[w * M_O : (w + 1) * M_O]) for w, o in enumerate(self.owners))
        return dict(max_err=max_err(self.out, ref), slot_max_err=slots, ref_scale=ref.abs().max().item())
