"""A reusable world of N processes with a process group, for tests, the demo and benchmarks.

Spawning a world and initialising gloo costs seconds; compiling costs more. A
:class:`World` starts N worker processes once and then runs many jobs on them::

    with World(2) as world:
        results = world.run(my_module.check_rank, 3)   # check_rank(3) on every rank

A job is a module-level function (pickled by reference) run on every rank at once; its
per-rank return values come back as a list. An exception on any rank becomes a
:class:`WorldError` naming the rank, with its traceback. A job that does not finish within
its timeout kills the world and raises :class:`WorldTimeout`: nothing hangs forever. A
world whose job failed is restarted on the next ``run``, since its ranks may disagree about
what collectives are in flight.

Workers are plain subprocesses started with an optional per-rank command prefix
(``ip netns exec ns0 ...``), so the same World runs ranks inside network namespaces for
the emulated-cluster benchmark. Jobs travel over a Unix socket (file-system sockets work
across network namespaces); gloo rendezvous is a FileStore.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection
from typing import Any


class WorldError(RuntimeError):
    """A job raised on some rank."""


class WorldTimeout(WorldError):
    """A job did not finish in time; the world was killed."""


class World:
    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout: float = 300.0,
        env: dict[str, str] | None = None,
        rank_env: Callable[[int], dict] | None = None,
        rank_prefix: Callable[[int], Sequence[str]] | None = None,
        threads: int = 1,
        pg_timeout: float = 120.0,
    ):
        """
        world_size: number of ranks. backend: process-group backend ("gloo").
        timeout: default seconds a job may take. env / rank_env(rank): extra environment.
        rank_prefix(rank): command prefix for that rank's process (e.g. ["ip", "netns", "exec", "ns0"]).
        threads: torch intra-op threads per rank. pg_timeout: the process group's own timeout.
        (gloo runs its default 2 worker threads: init_process_group ignores gloo's pg_options
        as of torch 2.13, so a thread count cannot be set here.)
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.backend, self.timeout = world_size, backend, timeout
        self.env, self.rank_env, self.rank_prefix = dict(env or {}), rank_env, rank_prefix
        self.threads, self.pg_timeout = threads, pg_timeout
        self._procs: list[subprocess.Popen] = []
        self._conns: list = []
        self._dir: str | None = None
        self._listener = None

    # ------------------------------------------------------------------ lifecycle
    def start(self):
        if self._procs:
            return self
        self._dir = tempfile.mkdtemp(prefix="overlapc-world-")
        os.chmod(self._dir, 0o755)
        sock = os.path.join(self._dir, "jobs.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(sock)
        self._listener.listen(self.world_size)
        self._listener.settimeout(1.0)
        store = os.path.join(self._dir, "store")
        path = [p or os.getcwd() for p in sys.path]  # "" (python -m, the REPL) means the cwd
        base_env = {**os.environ, **self.env, "PYTHONPATH": os.pathsep.join(path)}
        for rank in range(self.world_size):
            env = {**base_env, **(self.rank_env(rank) if self.rank_env else {})}
            cmd = [
                *(self.rank_prefix(rank) if self.rank_prefix else ()),
                sys.executable,
                "-m",
                "overlapc.testing.world",
                sock,
                str(rank),
                str(self.world_size),
                store,
                self.backend,
                str(self.threads),
                str(self.pg_timeout),
            ]
            self._procs.append(subprocess.Popen(cmd, env=env))
        conns: dict[int, Any] = {}
        deadline = time.monotonic() + 120
        while len(conns) < self.world_size:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self._procs):
                self.close()
                raise WorldError("world failed to start: a rank exited or did not connect within 120 s")
            try:
                s, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            s.setblocking(True)
            c = Connection(s.detach())
            rank = _recv(c)
            conns[rank] = c
        self._conns = [conns[r] for r in range(self.world_size)]
        return self

    def close(self):
        for c in self._conns:
            try:
                _send(c, None)
            except Exception:
                pass
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._kill()

    def _kill(self):
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for c in self._conns:
            try:
                c.close()
            except Exception:
                pass
        if self._listener is not None:
            try:
                self._listener.close()
            except Exception:
                pass
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._procs, self._conns, self._listener, self._dir = [], [], None, None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ jobs
    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; per-rank results, rank order."""
        ref = _fn_ref(fn)
        self.start()
        timeout = self.timeout if timeout is None else timeout
        name = ".".join(ref)
        payload = pickle.dumps((ref, args, kwargs))
        for c in self._conns:
            c.send_bytes(payload)
        results: list[Any] = [None] * self.world_size
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise WorldTimeout(
                    f"job {name} did not finish within {timeout:.0f} s on ranks {sorted(pending)}; the world was killed"
                )
            for r in list(pending):
                c = self._conns[r]
                if c.poll(min(0.05, max(left, 0))):
                    try:
                        ok, value = _recv(c)
                    except EOFError:
                        ok, value = False, f"rank {r} exited (code {self._procs[r].poll()})"
                    pending.discard(r)
                    if ok:
                        results[r] = value
                    else:
                        errors.append(f"rank {r}: {value}")
                elif self._procs[r].poll() is not None:
                    pending.discard(r)
                    errors.append(f"rank {r} exited with code {self._procs[r].returncode} during {name}")
            if errors and pending:
                # One rank failed: the others may wait on it forever. Give them a moment, then kill.
                grace = time.monotonic() + 10
                while pending and time.monotonic() < grace:
                    for r in list(pending):
                        if self._conns[r].poll(0.05):
                            ok, value = _recv(self._conns[r])
                            pending.discard(r)
                            if not ok:
                                errors.append(f"rank {r}: {value}")
                if pending:
                    self._kill()
                    pending.clear()
        if errors:
            self._kill()  # ranks may disagree on what is in flight: start afresh next time
            raise WorldError(f"job {name} failed\n" + "\n".join(errors))
        return results


def _fn_ref(fn) -> tuple[str, str]:
    """(module, qualname) of a module-level function; __main__ resolved to its import name."""
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not mod or not qual or "<locals>" in qual or "<lambda>" in qual:
        raise ValueError(f"World.run needs a module-level function, got {fn!r}")
    if mod == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is None:
            raise ValueError(
                f"World.run cannot send {qual} from a script run by path; "
                "run it with python -m, or move the function into a module"
            )
        mod = spec.name
    return mod, qual


def _resolve(ref: tuple[str, str]):
    import importlib

    obj = importlib.import_module(ref[0])
    for part in ref[1].split("."):
        obj = getattr(obj, part)
    return obj


def _send(conn, obj):
    # Plain pickle: torch registers fd-sharing reducers with multiprocessing's own pickler,
    # which need an authenticated resource sharer this socket does not have.
    conn.send_bytes(pickle.dumps(obj))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


# ---------------------------------------------------------------------- worker side
def _worker(sock: str, rank: int, world_size: int, store: str, backend: str, threads: int, pg_timeout: float):
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    conn = Client(sock, family="AF_UNIX")
    _send(conn, rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    try:
        while True:
            try:
                data = conn.recv_bytes()
            except EOFError:
                break
            try:
                job = pickle.loads(data)
                if job is None:
                    break
                ref, args, kwargs = job
                fn = _resolve(ref)
                torch._dynamo.reset()
                value = fn(*args, **kwargs)
                _send(conn, (True, value))
            except BaseException as e:  # report everything, including KeyboardInterrupt in a job
                _send(conn, (False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


if __name__ == "__main__":
    a = sys.argv[1:]
    _worker(a[0], int(a[1]), int(a[2]), a[3], a[4], int(a[5]), float(a[6]))
