"""WAN test bed: N hosts in Linux network namespaces on one bridge, each behind `tbf` limits.

Every host is a network namespace with one veth pair: the inner end (`eth0`, the host's
address in a private subnet) and the outer end enslaved to a bridge in the root namespace.
A token bucket (`tbf`, the kernel here has no `netem`) on the egress of both ends caps the
host's upload (inner end) and download (outer end) at its rate. Hosts reach only each other:
the bridge has no address and nothing is routed out.

    with Testbed(["boot", "h0", "h1"], rate_mbit=20) as bed:
        proc = bed.popen("h0", ["python", "-m", "http.server", "--bind", bed.addr("h0")])
        bed.run("h1", ["curl", f"http://{bed.addr('h0')}:8000/"], timeout=10)

`bed.partition(["boot", "h0"], ["h1", "h2"])` cuts the sides off from each other (packets
dropped both ways by iptables rules inside each host's namespace, as a failed WAN link
would), each side still reaching itself; `bed.heal()` removes the cut. Needs `iptables`.

**NAT hosts** (`nat=["h1"]`): such a host sits behind a home router of its own, a namespace
with a WAN end on the bridge (taking the host's slot on the public subnet, so
`public_addr("h1")` is the router's) and a LAN (`192.168.<k>.0/24`, router `.1`, host `.2`
= `addr("h1")`) to the host. The router masquerades what leaves through its WAN and forwards
only replies back in (conntrack ESTABLISHED,RELATED): no port forwards, no UPnP, and the
router itself answers nothing on its WAN (dropped, as most home routers do). The host's
rate limits sit on its LAN link. With NAT hosts the bed's "internet" also drops what is
sent to an address it has no host for (a default route to a neighbour that does not
exist), so dialling a NATed host's private address times out as it does on the internet
rather than failing at once; and the bridge gets a globally routable subnet
(`PUBLIC_SUBNET`), as libp2p treats relays on private addresses as unusable. Needs
`iptables` (iptables-restore) besides `ip` and `tc`; `unavailable_reason(nat=True)` says
why not.

    with Testbed(["boot", "pub", "home"], nat=["home"]) as bed:
        bed.addr("home")         # 192.168.1.2: what it listens on
        bed.public_addr("home")  # 11.77.0.3: its router, where its connections come from

Names carry a tag unique to the run (`dtb` + 5 hex digits) and the owner's pid, so parallel
runs never clash and `python -m testbed.hosts sweep` can remove what a SIGKILLed owner left.
`close()` (also run by the context manager, at exit, and on SIGTERM/SIGHUP) kills every
process left in the namespaces, then deletes the namespaces (which removes their veth pairs)
and the bridge. Needs root, `ip` and `tc`; `unavailable_reason()` says why not.

As a script: `python -m testbed.hosts up --hosts 3 --rate 20` brings a test bed up and
holds it until Ctrl+C; `sweep` removes leftovers of dead owners; `check` prints whether a
test bed can be built here.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from types import FrameType, TracebackType
from typing import Any

__all__ = ["PARTITION_CHAIN", "Host", "SwarmHosts", "Testbed", "TestbedError", "leftovers",
           "measure_mbit", "pid_alive", "swarm_on_testbed", "sweep", "unavailable_reason"]

PREFIX = "dtb"  # every namespace and link of a test bed starts with this
_NS_RE = re.compile(rf"^{PREFIX}-({PREFIX}[0-9a-f]{{5}})-(\d+)-")
# The bridge's subnet. With NAT hosts it must look like the internet: libp2p advertises a
# relay's circuit addresses only when the relay's own address is public (go-multiaddr's
# IsPublicAddr), so a NATed host behind relays on 10.x would stay unreachable. 11.77.0.0/24
# is globally routable space, which the bed never routes anywhere outside itself.
PRIVATE_SUBNET = "10.77.0.0/24"
PUBLIC_SUBNET = "11.77.0.0/24"
CMD_TIMEOUT_S = 20.0  # one `ip`/`tc` call; they take milliseconds unless the kernel is stuck
PARTITION_CHAIN = "DTBPART"  # iptables chain, inside a host's namespace, holding its cuts


class TestbedError(RuntimeError):
    """A test bed could not be built or torn down; the message names the failing command."""

    __test__ = False  # not a pytest test class despite its name


@dataclass(frozen=True)
class Host:
    """One emulated machine: its namespace, address and the root-side end of its link."""

    name: str
    netns: str
    addr: str
    veth: str  # outer end, in the root namespace (its egress is the host's download)
    rate_mbit: float | None
    # Behind a NAT: the namespace of its router and the router's address on the bridge.
    router: str | None = None
    wan_addr: str | None = None

    @property
    def public_addr(self) -> str:
        """The address peers on the bridge see this host's connections come from."""
        return self.wan_addr or self.addr


# Inside a NAT router: its two links, and the whole firewall (iptables-restore input).
_WAN, _LAN = "wan", "lan"
_ROUTER_RULES = f"""*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
-A POSTROUTING -o {_WAN} -j MASQUERADE
COMMIT
*filter
:INPUT DROP [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
-A INPUT -i lo -j ACCEPT
-A INPUT -i {_LAN} -j ACCEPT
-A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -i {_LAN} -o {_WAN} -j ACCEPT
-A FORWARD -i {_WAN} -o {_LAN} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
COMMIT
"""
# A neighbour nobody answers for: the "internet" default route, where traffic to addresses
# without a host on the bridge (other homes' private addresses) is silently lost.
_SINK_MAC = "02:00:5e:00:00:fe"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _sh(["ip", *args], check=check)


def _sh(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed ({proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def unavailable_reason(nat: bool = False, partitions: bool = False) -> str | None:
    """Why a test bed cannot be built here (None: it can): root, `ip` and `tc` are needed;
    to cut links (`partitions`: `Testbed.partition`) also `iptables`; for NAT hosts (`nat`)
    also `iptables-restore` and a kernel that masquerades in a network namespace (checked by
    building one router and removing it)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the WAN test bed needs root (network namespaces, veth, tbf)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the WAN test bed needs `{tool}` (iproute2) on PATH"
    if partitions and shutil.which("iptables") is None:
        return "cutting links on the test bed needs `iptables` (Debian: apt-get install iptables)"
    if nat:
        return _nat_unavailable_reason()
    return None


def _nat_unavailable_reason() -> str | None:
    if shutil.which("iptables-restore") is None:
        return "NAT hosts need `iptables-restore` (Debian: apt-get install iptables)"
    netns = f"{PREFIX}-{PREFIX}{secrets.token_hex(3)[:5]}-{os.getpid()}-natcheck"
    try:
        _ip("netns", "add", netns)
        proc = subprocess.run(["ip", "netns", "exec", netns, "iptables-restore"],
                              input=_ROUTER_RULES, capture_output=True, text=True,
                              timeout=CMD_TIMEOUT_S)
        if proc.returncode != 0:
            why = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            return f"the kernel refuses a NAT router in a namespace: {why[-1] if why else '?'}"
    except (TestbedError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot build a NAT router namespace: {exc}"
    finally:
        _ip("netns", "del", netns, check=False)
    return None


def tbf_args(rate_mbit: float) -> list[str]:
    """`tc` arguments of a token bucket at `rate_mbit`: a 10 ms burst (at least 32 KB, so one
    GSO burst fits) and 50 ms of queue, enough for TCP to fill the link between namespaces."""
    if not rate_mbit > 0:
        raise ValueError(f"rate_mbit = {rate_mbit}: must be > 0")
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(int(rate_bytes * 0.010), 32 * 1024)
    return ["tbf", "rate", f"{int(rate_mbit * 1000)}kbit", "burst", str(burst),
            "latency", "50ms"]


class Testbed:
    """N hosts on one bridge; see the module docstring. `start()` builds, `close()` removes.

    `nat` names the hosts that sit behind a NAT router each (module docstring); their
    LANs are /24s of `lan_subnet`. `subnet` (the bridge) defaults to `PRIVATE_SUBNET`, or
    with NAT hosts to `PUBLIC_SUBNET`.
    """

    __test__ = False  # not a pytest test class despite its name

    def __init__(self, hosts: int | Sequence[str], rate_mbit: float | None = None,
                 subnet: str | None = None, rates: dict[str, float | None] | None = None,
                 handle_signals: bool = True, nat: Iterable[str] = (),
                 lan_subnet: str = "192.168.0.0/16") -> None:
        names = [f"h{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"hosts = {names!r}: need at least one host, names unique")
        natted = list(dict.fromkeys(nat))
        if unknown := [n for n in natted if n not in names]:
            raise ValueError(f"nat = {unknown!r}: not among the hosts {names!r}")
        subnet = subnet or (PUBLIC_SUBNET if natted else PRIVATE_SUBNET)
        net = ipaddress.ip_network(subnet)
        # With NAT hosts the last address is the sink of the bed's default route.
        if len(names) > net.num_addresses - 2 - bool(natted):
            raise ValueError(f"subnet = {subnet}: too small for {len(names)} hosts")
        lans = list(ipaddress.ip_network(lan_subnet).subnets(new_prefix=24))[1:]
        if len(natted) > len(lans):
            raise ValueError(f"lan_subnet = {lan_subnet}: too small for {len(natted)} LANs")
        if any(lan.overlaps(net) for lan in lans[:len(natted)]):
            raise ValueError(f"lan_subnet = {lan_subnet} overlaps subnet = {subnet}")
        self.tag = PREFIX + secrets.token_hex(3)[:5]
        self.prefixlen = net.prefixlen
        self.sink = str(net.broadcast_address - 1) if natted else None
        rates = rates or {}
        self.hosts: dict[str, Host] = {}
        self._lans: dict[str, ipaddress.IPv4Network | ipaddress.IPv6Network] = {}
        for i, name in enumerate(names):
            netns = f"{PREFIX}-{self.tag}-{os.getpid()}-{name}"
            public = str(net.network_address + i + 1)
            host = Host(name=name, netns=netns, addr=public, veth=f"{self.tag}v{i}",
                        rate_mbit=rates.get(name, rate_mbit))
            if name in natted:
                lan = self._lans[name] = lans[natted.index(name)]
                host = Host(name=name, netns=netns, addr=str(lan.network_address + 2),
                            veth=host.veth, rate_mbit=host.rate_mbit,
                            router=f"{netns}-gw", wan_addr=public)
            self.hosts[name] = host
        self.bridge = f"{self.tag}br"
        self.handle_signals = handle_signals
        self._lock = threading.Lock()
        self._started = False
        self._old_handlers: dict[int, Any] = {}

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> Testbed:
        """Create the bridge, the namespaces, their links and limits (all or nothing)."""
        if (reason := unavailable_reason()) is not None:
            raise TestbedError(reason)
        with self._lock:
            self._started = True  # from here on close() has something to undo
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for host in self.hosts.values():
                self._add_host(host)
        except BaseException:
            self.close()
            raise
        return self

    def _add_host(self, host: Host) -> None:
        _ip("netns", "add", host.netns)
        if host.router is None:
            self._attach(host.netns, "eth0", host.veth, host.addr)
        else:
            self._add_router(host)
        _ip("-n", host.netns, "link", "set", "lo", "up")
        if host.rate_mbit is not None:
            self.set_rate(host.name, host.rate_mbit)

    def _attach(self, netns: str, dev: str, veth: str, addr: str) -> None:
        """Link `netns` to the bridge as `dev` with public address `addr`."""
        _ip("link", "add", veth, "type", "veth", "peer", "name", dev, "netns", netns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", netns, "addr", "add", f"{addr}/{self.prefixlen}", "dev", dev)
        _ip("-n", netns, "link", "set", dev, "up")
        if self.sink is not None:  # the "internet": silently loses what has no host here
            _ip("-n", netns, "neigh", "add", self.sink, "lladdr", _SINK_MAC, "dev", dev,
                "nud", "permanent")
            _ip("-n", netns, "route", "add", "default", "via", self.sink, "dev", dev)

    def _add_router(self, host: Host) -> None:
        """`host`'s home router: WAN on the bridge, masquerading, a LAN to the host."""
        router, lan = host.router, self._lans[host.name]
        assert router is not None and host.wan_addr is not None
        gateway = str(lan.network_address + 1)
        _ip("netns", "add", router)
        _ip("-n", router, "link", "set", "lo", "up")
        self._attach(router, _WAN, host.veth, host.wan_addr)
        _ip("-n", router, "link", "add", _LAN, "type", "veth", "peer", "name", "eth0",
            "netns", host.netns)
        _ip("-n", router, "addr", "add", f"{gateway}/{lan.prefixlen}", "dev", _LAN)
        _ip("-n", router, "link", "set", _LAN, "up")
        _ip("-n", host.netns, "addr", "add", f"{host.addr}/{lan.prefixlen}", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        _ip("-n", host.netns, "route", "add", "default", "via", gateway)
        _sh(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        proc = subprocess.run(["ip", "netns", "exec", router, "iptables-restore"],
                              input=_ROUTER_RULES, capture_output=True, text=True,
                              timeout=CMD_TIMEOUT_S)
        if proc.returncode != 0:
            raise TestbedError(f"NAT rules of {host.name}'s router failed: "
                               f"{proc.stderr.strip() or proc.stdout.strip()}")

    def set_rate(self, name: str, rate_mbit: float | None) -> None:
        """Cap host `name` at `rate_mbit` each way (None: remove the cap). A NATed host's
        caps sit on its LAN link: its upload on the host's end, download on the router's."""
        host = self.hosts[name]
        download = ([], host.veth) if host.router is None else (["-n", host.router], _LAN)
        for ns_args, dev in ((["-n", host.netns], "eth0"), download):
            _sh(["tc", *ns_args, "qdisc", "del", "dev", dev, "root"], check=False)
            if rate_mbit is not None:
                _sh(["tc", *ns_args, "qdisc", "add", "dev", dev, "root", *tbf_args(rate_mbit)])
        self.hosts[name] = replace(host, rate_mbit=rate_mbit)

    def partition(self, *sides: Sequence[str]) -> None:
        """Drop every packet between hosts of different `sides`, both ways, until `heal()`.
        Hosts named in no side are left alone (they still reach everyone)."""
        named = [n for side in sides for n in side]
        if len(set(named)) != len(named) or not set(named) <= set(self.hosts):
            raise ValueError(f"sides = {sides!r}: each host once, of {sorted(self.hosts)}")
        self.heal()
        for i, side in enumerate(sides):
            # A NATed host's packets show its router's address, and it is reached there.
            others = [self.public_addr(n) for j, other in enumerate(sides) if j != i
                      for n in other]
            for name in side:
                self._cut(name, others)

    def _cut(self, name: str, addrs: list[str]) -> None:
        ns = ["ip", "netns", "exec", self.hosts[name].netns, "iptables"]
        if _sh([*ns, "-n", "-L", PARTITION_CHAIN], check=False).returncode != 0:
            _sh([*ns, "-N", PARTITION_CHAIN])
            _sh([*ns, "-I", "INPUT", "-j", PARTITION_CHAIN])
            _sh([*ns, "-I", "OUTPUT", "-j", PARTITION_CHAIN])
        for addr in addrs:
            _sh([*ns, "-A", PARTITION_CHAIN, "-s", addr, "-j", "DROP"])
            _sh([*ns, "-A", PARTITION_CHAIN, "-d", addr, "-j", "DROP"])

    def heal(self) -> None:
        """Remove every cut `partition` made (idempotent)."""
        for host in self.hosts.values():
            _sh(["ip", "netns", "exec", host.netns, "iptables", "-F", PARTITION_CHAIN],
                check=False)

    def close(self) -> None:
        """Kill what runs in the namespaces, delete them and the bridge (idempotent)."""
        with self._lock:
            if not self._started:
                return
            self._started = False
        self._restore_signal_handlers()
        errors = []
        for host in self.hosts.values():
            for netns in (host.netns, host.router):
                if netns is None:
                    continue
                _kill_netns_pids(netns)
                proc = _ip("netns", "del", netns, check=False)
                if proc.returncode != 0 and "No such file" not in proc.stderr:
                    errors.append(proc.stderr.strip())
        for link in [self.bridge, *(h.veth for h in self.hosts.values())]:
            _ip("link", "del", link, check=False)  # the veths went with their namespaces
        atexit.unregister(self.close)
        if errors:
            raise TestbedError("test bed teardown: " + "; ".join(errors))

    def __enter__(self) -> Testbed:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _install_signal_handlers(self) -> None:
        # Python's default SIGTERM/SIGHUP end the process without unwinding: no atexit, no
        # __exit__. Tear down first, then let the previous disposition act.
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, old)
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        old = self._old_handlers.get(signum, signal.SIG_DFL)
        self.close()  # restores `old` as the handler
        if callable(old):
            old(signum, frame)
        elif old == signal.SIG_DFL:
            os.kill(os.getpid(), signum)

    # -- using hosts -----------------------------------------------------------------------
    def addr(self, name: str) -> str:
        """The address host `name` listens on (a NATed host's private LAN address)."""
        return self.hosts[name].addr

    def public_addr(self, name: str) -> str:
        """Where host `name`'s connections appear to come from (its router's, behind NAT)."""
        return self.hosts[name].public_addr

    def natted(self) -> list[str]:
        """The hosts behind a NAT router."""
        return [h.name for h in self.hosts.values() if h.router is not None]

    def wrap(self, name: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside host `name` (`ip netns exec` execs it: same pid, same signals)."""
        return ["ip", "netns", "exec", self.hosts[name].netns, *argv]

    def popen(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.wrap(name, argv), **kwargs)

    def run(self, name: str, argv: Sequence[str], timeout: float,
            **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        return subprocess.run(self.wrap(name, argv), timeout=timeout, **kwargs)


_RECEIVER = """
import socket, sys, time
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
s.settimeout(float(sys.argv[3]))
conn, _ = s.accept()
conn.settimeout(float(sys.argv[3]))
n, t0 = 0, None
while chunk := conn.recv(1 << 20):
    t0 = t0 or time.perf_counter()
    n += len(chunk)
print(n, time.perf_counter() - t0)
"""
_SENDER = """
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[4])
while True:
    try:
        conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)  # the receiver is still starting: retry until the deadline
conn.settimeout(float(sys.argv[4]))
left, block = int(sys.argv[3]), b"x" * (1 << 20)
while left > 0:
    conn.sendall(block[:left])
    left -= len(block)
conn.close()
"""


def measure_mbit(bed: Testbed, sender: str, receiver: str, nbytes: int,
                 timeout: float = 60.0, port: int = 5201) -> float:
    """Goodput in Mbit/s of one TCP stream carrying `nbytes` from `sender` to `receiver`."""
    args = [bed.addr(receiver), str(port)]
    recv = bed.popen(receiver, [sys.executable, "-c", _RECEIVER, *args, str(timeout)],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        bed.run(sender, [sys.executable, "-c", _SENDER, *args, str(nbytes), str(timeout)],
                timeout=timeout, check=True, capture_output=True)
        out, err = recv.communicate(timeout=timeout)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(timeout=5)
    if recv.returncode != 0:
        raise TestbedError(f"throughput receiver on {receiver} failed: {err.strip()[-300:]}")
    got, seconds = out.split()
    if int(got) != nbytes:
        raise TestbedError(f"throughput: received {got} of {nbytes} bytes")
    return int(got) * 8 / float(seconds) / 1e6


class SwarmHosts:
    """Puts the processes of a `LocalSwarm` on test bed hosts (a `swarm.local.Placement`).

    A process runs on the host of its own name unless `place()` moved it: a churn run
    starts `node-5` on the host `node-1` left behind.
    """

    def __init__(self, bed: Testbed) -> None:
        self.bed = bed
        self.assigned: dict[str, str] = {}

    def place(self, process: str, host: str) -> None:
        if host not in self.bed.hosts:
            raise ValueError(f"host = {host!r}: not one of {sorted(self.bed.hosts)}")
        self.assigned[process] = host

    def host_of(self, process: str) -> str:
        host = self.assigned.get(process, process)
        if host not in self.bed.hosts:
            raise ValueError(f"process {process!r} has no host (hosts: {sorted(self.bed.hosts)})")
        return host

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        return self.bed.wrap(self.host_of(name), argv)

    def addr(self, name: str) -> str:
        return self.bed.addr(self.host_of(name))


@contextlib.contextmanager
def swarm_on_testbed(cfg: Any, nodes: int, rate_mbit: float | None, *, hosts: int | None = None,
                     forever: bool = False,
                     nat: Iterable[str] = ()) -> Iterator[tuple[Testbed, Any]]:
    """A test bed with hosts `bootstrap` (uncapped: DHT only) and `node-0..` (at `rate_mbit`),
    and a not yet started `LocalSwarm` of `nodes` nodes placed on them; both torn down after.
    `hosts` (default `nodes`) adds spare node hosts, for nodes started later; the hosts
    named in `nat` sit behind a NAT router each (no port forwards)."""
    from dilonode.cli.local_swarm import LocalSwarm

    names = ["bootstrap", *(f"node-{i}" for i in range(hosts or nodes))]
    with Testbed(names, rate_mbit, rates={"bootstrap": None}, nat=nat) as bed:
        swarm = LocalSwarm(cfg, nodes, forever, placement=SwarmHosts(bed))
        try:
            yield bed, swarm
        finally:
            swarm.stop()


def _kill_netns_pids(netns: str) -> None:
    """SIGKILL every process in `netns` (a namespace lives on while a process holds it)."""
    for _ in range(50):
        proc = _ip("netns", "pids", netns, check=False)
        pids = [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)  # dying processes leave the namespace within milliseconds
    raise TestbedError(f"processes in {netns} survived SIGKILL")


def leftovers(tags: Iterable[str] | None = None) -> list[str]:
    """Test bed namespaces and links that exist now (of `tags` only, when given)."""
    names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line]
    names += [line.split(":")[1].strip().split("@")[0]
              for line in _ip("-o", "link", "show").stdout.splitlines()]
    if tags is None:
        return [n for n in names if n.startswith(PREFIX)]
    starts = tuple(t for tag in tags for t in (tag, f"{PREFIX}-{tag}-"))
    return [n for n in names if starts and n.startswith(starts)]


def sweep() -> list[str]:
    """Remove namespaces and links of test beds whose owner process is gone."""
    removed: list[str] = []
    dead_tags: set[str] = set()
    for line in _ip("netns", "list").stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        m = _NS_RE.match(ns)
        if m and not pid_alive(int(m.group(2))):
            dead_tags.add(m.group(1))
            _kill_netns_pids(ns)
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    for name in leftovers(dead_tags):
        if not name.startswith(f"{PREFIX}-"):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie counts as gone: it ran to its end)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # Linux only, as the test bed itself
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:  # reaped meanwhile
        return False


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="WAN test bed: namespaces, a bridge, tbf limits")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a test bed and hold it until Ctrl+C")
    up.add_argument("--hosts", type=int, default=3, help="number of hosts")
    up.add_argument("--rate", type=float, default=None, help="Mbit/s each way per host")
    up.add_argument("--subnet", default=None,
                    help=f"default {PRIVATE_SUBNET}, with NAT hosts {PUBLIC_SUBNET}")
    up.add_argument("--nat", type=int, default=0,
                    help="put the last N hosts behind a NAT router each")
    sub.add_parser("sweep", help="remove leftovers of test beds whose owner died")
    check = sub.add_parser("check", help="say whether a test bed can be built here")
    check.add_argument("--nat", action="store_true", help="with NAT hosts")
    args = ap.parse_args(argv)
    if args.cmd == "check":
        reason = unavailable_reason(nat=args.nat)
        print(reason or "ok")
        return 1 if reason else 0
    if args.cmd == "sweep":
        print("\n".join(sweep()) or "nothing to remove")
        return 0
    natted = [f"h{i}" for i in range(max(args.hosts - args.nat, 0), args.hosts)]
    with Testbed(args.hosts, args.rate, args.subnet, nat=natted) as bed:
        for h in bed.hosts.values():
            behind = f", behind NAT {h.public_addr} (router netns {h.router})" if h.router else ""
            print(f"{h.name}: {h.addr} (netns {h.netns}, {h.rate_mbit or 'no'} Mbit/s cap"
                  f"{behind})")
        print(f"run inside a host: ip netns exec {next(iter(bed.hosts.values())).netns} CMD")
        print("Ctrl+C tears it down")
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
