"""An emulated cluster on one machine: each rank in its own network namespace, all joined by
veth pairs to a bridge that lives in a namespace of its own, every link shaped with
``tc qdisc ... tbf`` (token bucket; netem is not available on these kernels).

Communication then costs wall time at the configured rate without costing CPU, so
overlapping it with compute shows up as real speedup. Requires root (``ip netns``).

    with EmulatedCluster(2, rate_mbit=400) as cluster:
        world = cluster.world()          # an overlapc.testing.world.World whose ranks run in the namespaces
        cluster.set_rate(800)            # change every link's rate live

Everything it creates is removed on exit, on error, on Ctrl-C and on SIGTERM. Names carry
a per-run tag (``ovc<pid>...``); ``EmulatedCluster.cleanup_stale()`` removes namespaces a
killed run left behind.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys

PREFIX = "ovc"


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
    return p


def _ns_exec(ns: str, *cmd: str, check: bool = True):
    return _run("ip", "netns", "exec", ns, *cmd, check=check)


def tbf_args(rate_mbit: float) -> list[str]:
    """tbf rate/burst/latency for ``rate_mbit``. The bucket must hold at least one timer
    tick of traffic (HZ=250: rate/250), or the shaper cannot reach its rate."""
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(32 * 1024, int(rate_bytes / 250 * 2))
    return ["rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "200ms"]


class EmulatedCluster:
    def __init__(self, world_size: int, rate_mbit: float = 1000.0, tag: str | None = None):
        if os.geteuid() != 0:
            raise PermissionError("the emulated cluster needs root (ip netns, tc)")
        self.world_size = world_size
        self.rate_mbit = rate_mbit
        self.tag = tag or f"{PREFIX}{os.getpid() % 100000}"
        self.bridge_ns = f"{self.tag}-br"
        self.rank_ns = [f"{self.tag}-r{r}" for r in range(world_size)]
        self.subnet = 10 + (os.getpid() % 200)
        self._up = False
        self._old_handlers = {}

    # ------------------------------------------------------------------ lifecycle
    def up(self):
        if self._up:
            return self
        atexit.register(self.down)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        self._up = True
        try:
            _run("ip", "netns", "add", self.bridge_ns)
            _ns_exec(self.bridge_ns, "ip", "link", "add", "br0", "type", "bridge")
            _ns_exec(self.bridge_ns, "ip", "link", "set", "br0", "up")
            _ns_exec(self.bridge_ns, "ip", "link", "set", "lo", "up")
            for r, ns in enumerate(self.rank_ns):
                _run("ip", "netns", "add", ns)
                # veth pair created in the bridge namespace, one end moved into the rank's.
                _ns_exec(self.bridge_ns, "ip", "link", "add", f"p{r}", "type", "veth", "peer", "name", f"tmp{r}")
                _ns_exec(self.bridge_ns, "ip", "link", "set", f"tmp{r}", "netns", ns)
                _ns_exec(ns, "ip", "link", "set", f"tmp{r}", "name", "eth0")
                _ns_exec(ns, "ip", "addr", "add", f"10.77.{self.subnet}.{r + 1}/24", "dev", "eth0")
                _ns_exec(ns, "ip", "link", "set", "eth0", "up")
                _ns_exec(ns, "ip", "link", "set", "lo", "up")
                _ns_exec(self.bridge_ns, "ip", "link", "set", f"p{r}", "master", "br0")
                _ns_exec(self.bridge_ns, "ip", "link", "set", f"p{r}", "up")
            self.set_rate(self.rate_mbit, add=True)
        except BaseException:
            self.down()
            raise
        return self

    def set_rate(self, rate_mbit: float, add: bool = False):
        """Shape every link, both directions: rank -> bridge (eth0 egress) and bridge -> rank."""
        verb = "add" if add else "change"
        for r, ns in enumerate(self.rank_ns):
            _ns_exec(ns, "tc", "qdisc", verb, "dev", "eth0", "root", "tbf", *tbf_args(rate_mbit))
            _ns_exec(self.bridge_ns, "tc", "qdisc", verb, "dev", f"p{r}", "root", "tbf", *tbf_args(rate_mbit))
        self.rate_mbit = rate_mbit

    def down(self):
        if not self._up:
            return
        self._up = False
        # A second signal while deleting (``timeout`` forwarding its SIGTERM, a ``pkill``
        # that also hits the wrapper) would abort the loop and leave namespaces behind.
        for sig in self._old_handlers:
            signal.signal(sig, signal.SIG_IGN)
        for ns in [*self.rank_ns, self.bridge_ns]:
            _run("ip", "netns", "del", ns, check=False)
        for sig, h in self._old_handlers.items():
            signal.signal(sig, h)
        self._old_handlers.clear()

    def _on_signal(self, signum, frame):
        self.down()
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()

    @staticmethod
    def cleanup_stale():
        """Remove namespaces left by runs that were killed with SIGKILL."""
        out = _run("ip", "netns", "list", check=False).stdout.split()
        for name in out:
            if name.startswith(PREFIX) and ("-br" in name or "-r" in name):
                pid = name[len(PREFIX) :].split("-")[0]
                if not pid.isdigit() or not os.path.exists(f"/proc/{pid}"):
                    _run("ip", "netns", "del", name, check=False)

    # ------------------------------------------------------------------ ranks
    def world(self, **kw):
        from overlapc.testing.world import World

        return World(
            self.world_size,
            rank_prefix=lambda r: ["ip", "netns", "exec", self.rank_ns[r]],
            rank_env=lambda r: {"GLOO_SOCKET_IFNAME": "eth0"},
            **kw,
        )


if __name__ == "__main__":
    # python -m overlapc.testing.cluster cleanup   -- remove namespaces of killed runs
    if sys.argv[1:] == ["cleanup"]:
        EmulatedCluster.cleanup_stale()
