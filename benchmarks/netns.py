"""Network namespaces for the benchmarks that need a link: W ranks, one per namespace, joined by veths
(and a bridge namespace), the link(s) limited with `tc tbf`; a Python entry point run in every namespace
with that rank's environment; the results collected; everything torn down, always.

    from benchmarks.netns import Link, Namespaces

    with Namespaces(2, "one_node", Link(rate="200mbit"), prefix="mph") as ns:
        runs = ns.run(lambda rank: [sys.executable, script, "--worker"], timeout=600)
        runs[0].result            # the JSON rank 0 wrote to $NETNS_RESULT (None if it wrote none)
        ns.set_rate(None)         # lift the limit (e.g. to time the same step without it); ns.set_rate("200mbit")
        ns.settings()             # rate, burst, latency, MTU, layout, addresses: for the JSON
        ns.probe()                # bytes/s one rank actually sends another through the link (a TCP stream)

    # inside a rank, while the ranks run: the launching process changes the link, then answers
    from benchmarks.netns import request_rate
    if rank == 0:
        request_rate(None)        # no limit from now on (request_rate("200mbit"): the limit again)
    dist.barrier()

`Loopback(W)` has the same `run` / `settings` on the host's loopback (no namespaces, no limit; for
debugging a benchmark without root): one code path for both.

Layouts (tc's netem is not available in this kernel: tbf is the limit, no added delay):
  one_node   every link limited. W=2: the two rank namespaces joined directly by one veth pair, tbf on
             both ends (each direction limited once). W>2: each rank's veth into a bridge in the switch
             namespace, tbf on both ends of every rank's veth (rank -> bridge and bridge -> rank).
  two_nodes  ranks [0, W/2) on node A, [W/2, W) on node B: each rank's veth into its node's bridge in the
             switch namespace (no limit: intra-node); the two bridges joined by one veth pair limited with
             tbf in both directions (inter-node).

Names: the namespaces are `{prefix}-r{rank}` and `{prefix}-sw`; every interface is created inside its
namespace (`ip link add ... netns ...`), so the host's own namespace never holds one of ours, not even
for a moment; each set of namespaces has its own addresses ({subnet}.{rank+1}/24), invisible to any other.
Two benchmarks with different prefixes never touch each other's namespaces.

Cleanup: entering deletes what a crashed run with the same prefix left (namespaces no process runs in);
a namespace of ours that a live process still runs in means another run of the same benchmark, and
entering raises, naming the pids, rather than pull the link out from under it. Leaving deletes every
namespace of ours (idempotent: also after a failure half-way through `up`). `python benchmarks/netns.py
--cleanup PREFIX` does the same by hand.

Per rank, `run` sets MASTER_ADDR (rank 0's address) / MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE (ranks of its node), GLOO_SOCKET_IFNAME (its interface), NETNS_RESULT (a file the
entry point may write JSON to) and NETNS_CONTROL (the directory `request_rate` talks through). Output goes to files, not pipes (a full pipe would stall a rank inside a
collective while its peer waits); a failed or timed-out rank stops the others and raises with every
rank's output tail. Needs root (`ip netns`, `tc`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

LAYOUTS = ("one_node", "two_nodes")
_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
          "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}  # tc's units: "mbit" megabits, "mbps" megabytes


@dataclass(frozen=True)
class Link:
    """A limited link: tc tbf `rate` (None: no limit), `burst` (bucket size), `latency` (longest a packet
    may queue before tbf drops it), and the MTU of every veth."""

    rate: str | None = "100mbit"
    burst: str = "64kb"
    latency: str = "100ms"
    mtu: int = 1500


def rate_bytes_per_s(rate: str) -> float:
    """tc's rate string ("200mbit", "1gbit", "10mbps") in bytes per second."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]+)\s*", rate.lower())
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"rate={rate!r} is invalid: use a number and one of tc's units {sorted(_UNITS)}, e.g. 200mbit")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _sh(cmd: str) -> None:
    proc = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"netns: `{cmd}` failed ({proc.returncode}): {proc.stderr.strip()} (needs root)")


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids(name: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


CONTROL_ENV = "NETNS_CONTROL"  # a directory: a rank's requests to the launching process, and their answers


@dataclass
class RankRun:
    """One rank's process: exit code, output tails, and the JSON it wrote to $NETNS_RESULT (or None)."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    result: object = None


class Namespaces:
    """W rank namespaces joined as `layout` says (see the module doc); a context manager."""

    def __init__(self, world: int, layout: str = "one_node", link: Link | None = None, *, prefix: str,
                 subnet: str = "10.77.0", port: int = 29500):
        if layout not in LAYOUTS:
            raise ValueError(f"Namespaces(layout={layout!r}) is invalid: use one of {list(LAYOUTS)}")
        if world < 2 or (layout == "two_nodes" and world % 2):
            raise ValueError(f"Namespaces(world={world}) is invalid for layout {layout!r}: use >= 2 ranks"
                             + (", an even number (two nodes of W/2)" if layout == "two_nodes" else ""))
        if not re.fullmatch(r"[a-z][a-z0-9]{1,7}", prefix):
            raise ValueError(f"Namespaces(prefix={prefix!r}) is invalid: use 2-8 lower-case letters/digits, "
                             f"starting with a letter (interface names are limited to 15 characters)")
        self.world, self.layout, self.link, self.prefix = world, layout, link or Link(), prefix
        self.subnet, self.port = subnet, port
        self._pattern = re.compile(rf"{re.escape(prefix)}-(r\d+|sw)")
        self._limited: list[tuple[str, str]] = []  # (namespace, device) pairs carrying the tbf limit

    # -- names ------------------------------------------------------------------------------------
    def ns(self, rank: int) -> str:
        return f"{self.prefix}-r{rank}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def ifname(self, rank: int) -> str:
        return f"{self.prefix}v{rank}"

    def addr(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    @property
    def master_addr(self) -> str:
        return self.addr(0)

    def node_of(self, rank: int) -> int:
        return 0 if self.layout == "one_node" or rank < self.world // 2 else 1

    # -- up / down --------------------------------------------------------------------------------
    def __enter__(self) -> Namespaces:
        self.cleanup(refuse_busy=True)
        try:
            self.up()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def cleanup(self, refuse_busy: bool = False) -> list[str]:
        """Delete every namespace of this prefix; returns their names. With `refuse_busy`, raise instead
        when a live process runs in one (another run of the same benchmark)."""
        ours = [n for n in _namespaces() if self._pattern.fullmatch(n)]
        if refuse_busy:
            busy = {n: pids for n in ours if (pids := _pids(n))}
            if busy:
                raise RuntimeError(f"netns: namespaces {busy} (name: pids) are in use: another run with prefix "
                                   f"{self.prefix!r}? Wait for it, or stop it; then retry.")
        for name in ours:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._limited = []
        return ours

    def _veth(self, ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
        _sh(f"ip link add {dev_a} netns {ns_a} mtu {self.link.mtu} type veth peer name {dev_b} netns {ns_b} "
            f"mtu {self.link.mtu}")
        _sh(f"ip -n {ns_a} link set {dev_a} up && ip -n {ns_b} link set {dev_b} up")

    def up(self) -> None:
        W, sw = self.world, self.switch
        for r in range(W):
            _sh(f"ip netns add {self.ns(r)} && ip -n {self.ns(r)} link set lo up")
        if self.layout == "one_node" and W == 2:  # one veth pair, limited at both ends
            self._veth(self.ns(0), self.ifname(0), self.ns(1), self.ifname(1))
            self._limited = [(self.ns(0), self.ifname(0)), (self.ns(1), self.ifname(1))]
        else:
            _sh(f"ip netns add {sw}")
            bridges = ["br0"] if self.layout == "one_node" else ["br0", "br1"]
            for br in bridges:
                _sh(f"ip -n {sw} link add {br} type bridge && ip -n {sw} link set {br} mtu {self.link.mtu} "
                    f"&& ip -n {sw} link set {br} up")
            for r in range(W):
                port = f"p{r}"
                self._veth(self.ns(r), self.ifname(r), sw, port)
                _sh(f"ip -n {sw} link set {port} master br{self.node_of(r)}")
                if self.layout == "one_node":
                    self._limited += [(self.ns(r), self.ifname(r)), (sw, port)]
            if self.layout == "two_nodes":  # the inter-node link between the bridges
                self._veth(sw, "x0", sw, "x1")
                _sh(f"ip -n {sw} link set x0 master br0 && ip -n {sw} link set x1 master br1")
                self._limited = [(sw, "x0"), (sw, "x1")]
        for r in range(W):
            _sh(f"ip -n {self.ns(r)} addr add {self.addr(r)}/24 dev {self.ifname(r)}")
        self.set_rate(self.link.rate)

    def set_rate(self, rate: str | None) -> None:
        """Put the tbf limit `rate` (with the link's burst and latency) on every limited device; None lifts it."""
        for ns, dev in self._limited:
            if rate is None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                               capture_output=True)
            else:
                rate_bytes_per_s(rate)  # validates
                _sh(f"ip netns exec {ns} tc qdisc replace dev {dev} root tbf rate {rate} burst {self.link.burst} "
                    f"latency {self.link.latency}")
        self.link = Link(rate, self.link.burst, self.link.latency, self.link.mtu)

    def qdiscs(self) -> dict[str, str]:
        """What tc reports on every limited device now ("ns/dev": qdisc line)."""
        out = {}
        for ns, dev in self._limited:
            shown = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                                   capture_output=True, text=True).stdout.strip()
            out[f"{ns}/{dev}"] = shown
        return out

    def settings(self) -> dict:
        """Everything that defines the link, for the JSON."""
        limited = "every rank's link" if self.layout == "one_node" else "the inter-node link only"
        if self.layout == "one_node" and self.world == 2:
            shape = "the two rank namespaces joined directly by one veth pair, tbf on both ends"
        elif self.layout == "one_node":
            shape = "each rank's veth into one bridge (switch namespace), tbf on both ends of every rank veth"
        else:
            shape = (f"ranks 0..{self.world // 2 - 1} = node A, {self.world // 2}..{self.world - 1} = node B: veths "
                     f"into per-node bridges (no limit), the bridges joined by one veth pair with tbf both ways")
        rate = self.link.rate
        return {"layout": self.layout, "world": self.world, "prefix": self.prefix, "subnet": self.subnet,
                **asdict(self.link), "qdisc": "tbf" if rate else None,
                "rate_bytes_per_s": rate_bytes_per_s(rate) if rate else None,
                "limited": limited, "topology": shape,
                "addresses": {r: self.addr(r) for r in range(self.world)},
                "intra": "none: every pair of ranks crosses a limited link" if self.layout == "one_node"
                else "veth into a per-node bridge, no limit",
                "inter": (f"tbf rate {rate} burst {self.link.burst} latency {self.link.latency}, both directions"
                          if rate else "no limit")}

    # -- running ----------------------------------------------------------------------------------
    def rank_env(self, rank: int, result: str) -> dict[str, str]:
        per_node = self.world if self.layout == "one_node" else self.world // 2
        return {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.port), "RANK": str(rank),
                "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(rank % per_node),
                "LOCAL_WORLD_SIZE": str(per_node), "GLOO_SOCKET_IFNAME": self.ifname(rank), "NETNS_RESULT": result}

    def run(self, argv: Callable[[int], Sequence[str]] | Sequence[str], *, env: dict[str, str] | None = None,
            timeout: float = 900, tail: int = 4000) -> list[RankRun]:
        """Run `argv` (or `argv(rank)`) in every rank's namespace at once; wait for all; collect. A rank's
        `request_rate(...)` sets this link's rate while they run.

        Raises RuntimeError when a rank exits non-zero (the others are stopped) or the run exceeds `timeout`
        seconds, with every rank's output tail."""
        def on_request(payload: dict) -> dict:
            self.set_rate(payload["rate"])
            return {"rate": self.link.rate, "qdiscs": self.qdiscs()}

        return launch(self.world, lambda r: ["ip", "netns", "exec", self.ns(r), *(argv(r) if callable(argv) else argv)],
                      lambda r, result, control: {**(env or {}), **self.rank_env(r, result), CONTROL_ENV: control},
                      timeout, tail, on_request, self.prefix)

    def probe(self, src: int = 0, dst: int = 1, nbytes: int = 8 << 20) -> float:
        """Bytes per second a TCP stream from rank `src` to rank `dst` achieves through the link now."""
        server = ("import socket,sys;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
                  f"s.bind(('{self.addr(dst)}',{self.port + 1}));s.listen(1);c,_=s.accept();n=0\n"
                  "while (b:=c.recv(1<<20)): n+=len(b)\nc.sendall(b'ok');print(n)")
        client = ("import socket,time;s=socket.socket()\n"
                  f"for _ in range(100):\n  try: s.connect(('{self.addr(dst)}',{self.port + 1})); break\n"
                  "  except OSError: time.sleep(0.05)\n"
                  f"buf=bytes(1<<20);t=time.perf_counter()\nfor _ in range({nbytes >> 20}): s.sendall(buf)\n"
                  "s.shutdown(socket.SHUT_WR);s.recv(2);print(time.perf_counter()-t)")
        srv = subprocess.Popen(["ip", "netns", "exec", self.ns(dst), sys.executable, "-c", server],
                               stdout=subprocess.PIPE, text=True)
        try:
            cli = subprocess.run(["ip", "netns", "exec", self.ns(src), sys.executable, "-c", client],
                                 capture_output=True, text=True, timeout=120)
            received = int(srv.communicate(timeout=30)[0].strip() or 0)
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait()
        if cli.returncode or received != (nbytes >> 20) << 20:
            raise RuntimeError(f"netns probe {src}->{dst} failed: {cli.stderr[-1000:]} (received {received} bytes)")
        return received / float(cli.stdout.strip())


# ----------------------------------------------------------------------------------------------
# Launching the ranks (namespaces or loopback), and a rank's requests to the launching process.
# ----------------------------------------------------------------------------------------------


def launch(world: int, command: Callable[[int], Sequence[str]],
           rank_env: Callable[[int, str, str], dict[str, str]], timeout: float, tail: int,
           on_request: Callable[[dict], dict], prefix: str) -> list[RankRun]:
    """Start `command(rank)` for every rank with os.environ + `rank_env(rank, result_file, control_dir)`;
    answer the ranks' requests with `on_request` while they run; wait for all; collect (see `Namespaces.run`)."""
    procs, logs = [], []
    with tempfile.TemporaryDirectory(prefix=f"{prefix}_run_") as tmp:
        control = Path(tmp, "control")
        control.mkdir()
        for r in range(world):
            env = {**os.environ, **rank_env(r, str(Path(tmp, f"result_{r}.json")), str(control))}
            out, err = open(Path(tmp, f"out_{r}"), "w+"), open(Path(tmp, f"err_{r}"), "w+")
            logs.append((out, err))
            procs.append(subprocess.Popen(list(command(r)), env=env, stdout=out, stderr=err, text=True))
        deadline, failed, answered = time.monotonic() + timeout, None, set()
        try:
            while any(p.poll() is None for p in procs):
                failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
                if failed is not None or time.monotonic() > deadline:
                    break
                for req in sorted(control.glob("req_*.json")):
                    if req.name not in answered:
                        answer = on_request(json.loads(req.read_text()))
                        _write_atomic(control / req.name.replace("req_", "ack_"), answer)
                        answered.add(req.name)
                time.sleep(0.05)
        finally:
            for p in procs:  # our own children only
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        runs = []
        for r, (p, (out, err)) in enumerate(zip(procs, logs)):
            out.seek(0)
            err.seek(0)
            path = Path(tmp, f"result_{r}.json")
            result = json.loads(path.read_text()) if path.exists() else None
            runs.append(RankRun(r, p.returncode, out.read()[-tail:], err.read()[-tail:], result))
            out.close()
            err.close()
    timed_out = time.monotonic() > deadline
    if timed_out or any(run.returncode for run in runs):
        why = f"timed out after {timeout:.0f} s" if timed_out else f"rank {failed} failed"
        tails = "\n".join(f"--- rank {run.rank} (exit {run.returncode}) ---\n{run.stdout}{run.stderr}" for run in runs)
        raise RuntimeError(f"netns run {why}:\n{tails}")
    return runs


def _write_atomic(path: Path, payload: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    tmp.rename(path)


_requests = 0  # this process's requests so far


def request_rate(rate: str | None, timeout: float = 60) -> dict:
    """In a rank started by `Namespaces.run` / `Loopback.run` (call it from one rank, then barrier): the
    launching process sets the link's tbf rate to `rate` (None: no limit) now; returns its answer (the
    rate and the qdiscs after; under `Loopback`, a note that there is no link)."""
    global _requests
    control = os.environ.get(CONTROL_ENV)
    if not control:
        raise RuntimeError(f"request_rate: ${CONTROL_ENV} is not set: start this rank with Namespaces.run or "
                           f"Loopback.run")
    _requests += 1
    name = f"{os.getpid()}_{_requests:05d}.json"
    _write_atomic(Path(control, f"req_{name}"), {"rate": rate})
    ack, deadline = Path(control, f"ack_{name}"), time.monotonic() + timeout
    while not ack.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"request_rate({rate!r}): no answer in {timeout:.0f} s from the launching process")
        time.sleep(0.02)
    return json.loads(ack.read_text())


class Loopback:
    """`Namespaces`' interface on the host's loopback, for debugging only: no namespaces, no link, no limit
    (`request_rate` is answered, and changes nothing)."""

    def __init__(self, world: int, *, prefix: str = "loop", port: int | None = None):
        import socket

        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.world, self.prefix, self.port, self.master_addr = world, prefix, port, "127.0.0.1"

    def __enter__(self) -> Loopback:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def settings(self) -> dict:
        return {"layout": "loopback", "world": self.world, "rate": None, "qdisc": None,
                "note": "loopback (--no-netns): no link limit; for debugging only, not a measurement of HP vs EP"}

    def run(self, argv: Callable[[int], Sequence[str]] | Sequence[str], *, env: dict[str, str] | None = None,
            timeout: float = 900, tail: int = 4000) -> list[RankRun]:
        def rank_env(r: int, result: str, control: str) -> dict[str, str]:
            return {**(env or {}), "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.port), "RANK": str(r),
                    "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(self.world),
                    "NETNS_RESULT": result, CONTROL_ENV: control}

        return launch(self.world, lambda r: list(argv(r) if callable(argv) else argv), rank_env, timeout, tail,
                      lambda payload: {"rate": None, "note": "loopback: no link to limit"}, self.prefix)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark network namespaces: clean up leftovers, or try a link.")
    parser.add_argument("--cleanup", metavar="PREFIX", help="delete the namespaces PREFIX-r<n> / PREFIX-sw")
    parser.add_argument("--try", dest="try_", metavar="RATE", help="build W=2 one_node at RATE, probe it, tear down")
    args = parser.parse_args(argv)
    if args.cleanup:
        print("deleted:", Namespaces(2, prefix=args.cleanup).cleanup(refuse_busy=True) or "nothing")
    if args.try_:
        with Namespaces(2, "one_node", Link(rate=args.try_), prefix="mptry") as ns:
            print(json.dumps(ns.settings(), indent=1))
            print(f"probe 0->1: {ns.probe() * 8 / 1e6:.1f} Mbit/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
