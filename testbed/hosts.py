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

**Delay, jitter and loss** (the kernel has no `netem`): `Testbed(..., delays={"h0": 40.0},
jitter={"h0": 5.0}, loss={"h1": 0.01})` gives each named host's access link a one-way delay
(ms), a jitter (ms, uniform in [-jitter, +jitter]) and a loss (per packet, each way); hosts
not named get 0. A packet from a to b is held delay_a + delay_b (each with its jitter) and
lost with probability 1 - (1 - loss_a)(1 - loss_b), so RTT_ab = 2 (delay_a + delay_b). A
flow is never reordered: the release times of a (source, destination) pair never decrease.
`set_link("h0", delay_ms=80)` changes a link while the bed runs; `link_stats()` gives the
emulator's counters (packets, bytes, drops, queue peak, how late packets left). Rates stay
the tbf's, so delay and a rate compose as on a real access link. `unavailable_reason(
delay=True)` says why not (a C compiler, `/dev/net/tun`).

    with Testbed(["a", "b"], rate_mbit=20, delays={"a": 20.0, "b": 20.0}) as bed:
        measure_mbit(bed, "a", "b", 20_000_000, sockbuf=800_000, skip_s=2)  # 80 ms RTT

How: one more namespace, a router (`...-linkem`) with a leg on the bridge at the subnet's
last free address. Hosts keep their addresses and their places on the bridge but reach the
subnet through the router instead of on the link (`noprefixroute`, the subnet via the
router), so the bridge, the tbf on both ends of every veth, the NAT routers and
`partition` are untouched, and one insertion point sees every packet between hosts with
their own addresses (a NATed host's: its router's). One veth per host into the router
instead would move each download limit into that namespace and give each host a subnet of
its own, for the saving of a second bridge crossing, cheap beside the emulator. In the
router, `ip rule iif <leg> lookup 100` (table 100: default via a TUN device) hands what
hosts send to `testbed/linkem.c`, which holds, drops and writes packets back into the TUN,
whence the main table routes them out of the leg. Nothing is proxied: TCP keeps its end-to-
end round trip. `testbed/linkem.py` compiles and runs it (SCHED_FIFO where allowed); it
ends with the bed (`close()`, SIGTERM, its owner's death closing its stdin) and `sweep`
removes what is left. `python -m testbed.hosts up --hosts 3 --delay 40 --loss 0.01` holds
one up. What was measured, and with which commands: docs/reports/2026-12-02-testbed-linkem.md.

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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import FrameType, TracebackType
from typing import Any

from testbed import linkem
from testbed.linkem import LinkEmulator, LinkSpec

__all__ = ["PARTITION_CHAIN", "Host", "LinkSpec", "SwarmHosts", "Testbed", "TestbedError",
           "leftovers", "measure_mbit", "pid_alive", "swarm_on_testbed", "sweep",
           "unavailable_reason"]

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
    link: LinkSpec = LinkSpec()  # delay, jitter and loss of its access link (the emulator's)

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
# Inside the emulator's router: its leg on the bridge, the TUN device, and the routing table
# that sends what arrives on the leg into the TUN.
_LEG, _TUN, _TUN_TABLE = "emu", "tun0", "100"
_TUN_QUEUE = 10_000  # packets the TUN holds while the emulator is busy (kernel default: 500)
_EMULATOR = "linkem"  # the router namespace's suffix, so no host may take this name
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


def unavailable_reason(nat: bool = False, partitions: bool = False,
                       delay: bool = False) -> str | None:
    """Why a test bed cannot be built here (None: it can): root, `ip` and `tc` are needed;
    to cut links (`partitions`: `Testbed.partition`) also `iptables`; for delay, jitter or
    loss (`delay`) a C compiler (or a cached emulator) and `/dev/net/tun`; for NAT hosts
    (`nat`) also `iptables-restore` and a kernel that masquerades in a network namespace
    (checked by building one router and removing it)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the WAN test bed needs root (network namespaces, veth, tbf)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the WAN test bed needs `{tool}` (iproute2) on PATH"
    if partitions and shutil.which("iptables") is None:
        return "cutting links on the test bed needs `iptables` (Debian: apt-get install iptables)"
    if delay and (why := linkem.unavailable_reason()) is not None:
        return why
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


def _link_specs(names: Sequence[str], delays: Mapping[str, float] | None,
                jitter: Mapping[str, float] | None,
                loss: Mapping[str, float] | None) -> dict[str, LinkSpec]:
    """Each named host's `LinkSpec` from the three per-host mappings (absent: 0)."""
    given = {"delays": delays or {}, "jitter": jitter or {}, "loss": loss or {}}
    for arg, values in given.items():
        if unknown := [n for n in values if n not in names]:
            raise ValueError(f"{arg} = {unknown!r}: not among the hosts {list(names)!r}")
    return {n: LinkSpec(delay_ms=given["delays"].get(n, 0.0),
                        jitter_ms=given["jitter"].get(n, 0.0), loss=given["loss"].get(n, 0.0))
            for n in names}


def _subnets(hosts: int, natted: int, subnet: str | None, lan_subnet: str,
             emulate: bool) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network,
                                     list[ipaddress.IPv4Network | ipaddress.IPv6Network]]:
    """The bridge's subnet and the /24s for NAT LANs, checked to fit and not to overlap."""
    subnet = subnet or (PUBLIC_SUBNET if natted else PRIVATE_SUBNET)
    net = ipaddress.ip_network(subnet)
    # The last addresses are the sink of the bed's default route (with NAT hosts) and
    # the emulator's router (with the emulator).
    if hosts > net.num_addresses - 2 - bool(natted) - emulate:
        raise ValueError(f"subnet = {subnet}: too small for {hosts} hosts")
    lans = list(ipaddress.ip_network(lan_subnet).subnets(new_prefix=24))[1:]
    if natted > len(lans):
        raise ValueError(f"lan_subnet = {lan_subnet}: too small for {natted} LANs")
    if any(lan.overlaps(net) for lan in lans[:natted]):
        raise ValueError(f"lan_subnet = {lan_subnet} overlaps subnet = {subnet}")
    return net, lans


class Testbed:
    """N hosts on one bridge; see the module docstring. `start()` builds, `close()` removes.

    `nat` names the hosts that sit behind a NAT router each (module docstring); their
    LANs are /24s of `lan_subnet`. `subnet` (the bridge) defaults to `PRIVATE_SUBNET`, or
    with NAT hosts to `PUBLIC_SUBNET`. `delays` (one-way ms), `jitter` (ms) and `loss`
    (per packet) set each named host's access link in the link emulator ("Delay, jitter
    and loss" in the module docstring), which runs when any of them is given or when
    `emulate` is true; `seed` fixes its random draws.
    """

    __test__ = False  # not a pytest test class despite its name

    def __init__(self, hosts: int | Sequence[str], rate_mbit: float | None = None,
                 subnet: str | None = None, rates: dict[str, float | None] | None = None,
                 handle_signals: bool = True, nat: Iterable[str] = (),
                 lan_subnet: str = "192.168.0.0/16", *,
                 delays: Mapping[str, float] | None = None,
                 jitter: Mapping[str, float] | None = None,
                 loss: Mapping[str, float] | None = None,
                 emulate: bool | None = None, seed: int | None = None) -> None:
        names = [f"h{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"hosts = {names!r}: need at least one host, names unique")
        natted = list(dict.fromkeys(nat))
        if unknown := [n for n in natted if n not in names]:
            raise ValueError(f"nat = {unknown!r}: not among the hosts {names!r}")
        links = _link_specs(names, delays, jitter, loss)
        self.emulate = bool(delays or jitter or loss) if emulate is None else emulate
        if self.emulate and _EMULATOR in names:
            raise ValueError(f"host name {_EMULATOR!r} is the link emulator's")
        net, lans = _subnets(len(names), len(natted), subnet, lan_subnet, self.emulate)
        self.tag = PREFIX + secrets.token_hex(3)[:5]
        self.prefixlen = net.prefixlen
        self.sink = str(net.broadcast_address - 1) if natted else None
        self.subnet = str(net)
        self.gateway = (str(net.broadcast_address - 1 - bool(natted)) if self.emulate
                        else None)  # the emulator's router: every host routes through it
        self.emulator_ns = f"{PREFIX}-{self.tag}-{os.getpid()}-{_EMULATOR}"
        self.linkem: LinkEmulator | None = None
        self.seed = seed
        rates = rates or {}
        self.hosts: dict[str, Host] = {}
        self._lans: dict[str, ipaddress.IPv4Network | ipaddress.IPv6Network] = {}
        for i, name in enumerate(names):
            netns = f"{PREFIX}-{self.tag}-{os.getpid()}-{name}"
            public = str(net.network_address + i + 1)
            host = Host(name=name, netns=netns, addr=public, veth=f"{self.tag}v{i}",
                        rate_mbit=rates.get(name, rate_mbit), link=links[name])
            if name in natted:
                lan = self._lans[name] = lans[natted.index(name)]
                host = replace(host, addr=str(lan.network_address + 2),
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
        if (reason := unavailable_reason(delay=self.emulate)) is not None:
            raise TestbedError(reason)
        with self._lock:
            self._started = True  # from here on close() has something to undo
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            if self.emulate:
                self._add_emulator()
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
        """Link `netns` to the bridge as `dev` with public address `addr`. With the
        emulator, the subnet is reached through its router rather than on the link."""
        _ip("link", "add", veth, "type", "veth", "peer", "name", dev, "netns", netns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        routed = [] if self.gateway is None else ["noprefixroute"]
        _ip("-n", netns, "addr", "add", f"{addr}/{self.prefixlen}", "dev", dev, *routed)
        _ip("-n", netns, "link", "set", dev, "up")
        if self.gateway is not None:
            _ip("-n", netns, "route", "add", self.gateway, "dev", dev, "scope", "link")
            _ip("-n", netns, "route", "add", self.subnet, "via", self.gateway, "dev", dev)
        if self.sink is not None:  # the "internet": silently loses what has no host here
            _ip("-n", netns, "neigh", "add", self.sink, "lladdr", _SINK_MAC, "dev", dev,
                "nud", "permanent")
            _ip("-n", netns, "route", "add", "default", "via", self.sink, "dev", dev,
                "onlink")

    def _add_emulator(self) -> None:
        """The router every packet between hosts crosses: in on its leg on the bridge, into
        the TUN device (policy routing: `iif` leg), through the emulator, and out of the
        TUN routed by the main table, back to the bridge."""
        ns, gateway = self.emulator_ns, self.gateway
        assert gateway is not None
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        self._attach_leg(ns, gateway)
        _ip("-n", ns, "tuntap", "add", "dev", _TUN, "mode", "tun")
        _ip("-n", ns, "link", "set", _TUN, "mtu", "1500", "txqueuelen", str(_TUN_QUEUE), "up")
        # Forwarding in and out of the same leg is the design: no redirects to tell hosts
        # to go direct. Packets come back from the TUN with their hosts' source addresses,
        # which the reverse-path filter would call spoofed.
        _sh(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1",
             "net.ipv4.conf.all.send_redirects=0", f"net.ipv4.conf.{_LEG}.send_redirects=0",
             "net.ipv4.conf.all.rp_filter=0", f"net.ipv4.conf.{_TUN}.rp_filter=0",
             f"net.ipv6.conf.{_TUN}.disable_ipv6=1"])
        _ip("-n", ns, "route", "add", "default", "dev", _TUN, "table", _TUN_TABLE)
        _ip("-n", ns, "rule", "add", "iif", _LEG, "lookup", _TUN_TABLE, "pref", "100")
        links = {h.public_addr: h.link for h in self.hosts.values()}
        self.linkem = LinkEmulator(["ip", "netns", "exec", ns], tun=_TUN, links=links,
                                   seed=self.seed)
        try:
            self.linkem.start()
        except linkem.LinkemError as exc:
            raise TestbedError(str(exc)) from exc

    def _attach_leg(self, ns: str, addr: str) -> None:
        _ip("link", "add", f"{self.tag}em", "type", "veth", "peer", "name", _LEG, "netns", ns)
        _ip("link", "set", f"{self.tag}em", "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{addr}/{self.prefixlen}", "dev", _LEG)
        _ip("-n", ns, "link", "set", _LEG, "up")

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

    def set_idle_restart(self, name: str, restart: bool) -> None:
        """`net.ipv4.tcp_slow_start_after_idle` in host `name`'s namespace (a per-namespace
        sysctl: no socket option turns it off). On (Linux's default), every connection's
        window restarts from 10 segments after an idle gap, each round on long links."""
        self.run(name, ["sysctl", "-qw", f"net.ipv4.tcp_slow_start_after_idle={int(restart)}"],
                 check=True, timeout=10)

    def set_link(self, name: str, delay_ms: float | None = None, jitter_ms: float | None = None,
                 loss: float | None = None) -> None:
        """Change host `name`'s access link in the emulator (None: keep that setting);
        packets already queued keep their release times. Needs a bed built with the
        emulator (`emulate=True` or any of delays, jitter, loss)."""
        host = self.hosts[name]
        if self.linkem is None:
            raise TestbedError("set_link: this test bed runs no link emulator (emulate=True)")
        old = host.link
        link = LinkSpec(delay_ms=old.delay_ms if delay_ms is None else delay_ms,
                        jitter_ms=old.jitter_ms if jitter_ms is None else jitter_ms,
                        loss=old.loss if loss is None else loss)
        try:
            self.linkem.set(host.public_addr, link)
        except linkem.LinkemError as exc:
            raise TestbedError(str(exc)) from exc
        self.hosts[name] = replace(host, link=link)

    def link_stats(self, reset: bool = False) -> dict[str, Any]:
        """The emulator's counters (`LinkEmulator.stats`): now (with `reset`, zeroed after
        reading), or the last ones once closed."""
        if self.linkem is None:
            raise TestbedError("link_stats: this test bed runs no link emulator")
        if self.linkem.proc is None and self.linkem.final is not None:
            return self.linkem.final
        try:
            return self.linkem.stats(reset)
        except linkem.LinkemError as exc:
            raise TestbedError(str(exc)) from exc

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
        if self.linkem is not None:
            self.linkem.close()  # first, so that its last counters are kept
        errors = []
        namespaces = [ns for h in self.hosts.values() for ns in (h.netns, h.router) if ns]
        for netns in [*namespaces, *([self.emulator_ns] if self.emulate else [])]:
            _kill_netns_pids(netns)
            proc = _ip("netns", "del", netns, check=False)
            if proc.returncode != 0 and "No such file" not in proc.stderr:
                errors.append(proc.stderr.strip())
        legs = [f"{self.tag}em"] if self.emulate else []
        for link in [self.bridge, *(h.veth for h in self.hosts.values()), *legs]:
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


# Socket buffers, when given, are forced past net.core.[rw]mem_max (the bed runs as root)
# with SO_RCVBUFFORCE (33) and SO_SNDBUFFORCE (32), which Python's socket module does not
# name. A listener's buffer passes to the connections it accepts.
_RECEIVER = """
import socket, sys, time
s = socket.socket()
if int(sys.argv[4]):
    s.setsockopt(socket.SOL_SOCKET, 33, int(sys.argv[4]))
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
s.settimeout(float(sys.argv[3]))
conn, _ = s.accept()
conn.settimeout(float(sys.argv[3]))
n, t0, skip, mark = 0, None, float(sys.argv[5]), None
while chunk := conn.recv(1 << 20):
    now = time.perf_counter()
    t0 = t0 or now
    if mark is None and now - t0 >= skip:
        mark = (n, now)
    n += len(chunk)
n0, t1 = mark or (0, t0)
print(n, time.perf_counter() - t1, n - n0)
"""
_SENDER = """
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[4])
while True:
    conn = socket.socket()
    if int(sys.argv[5]):
        conn.setsockopt(socket.SOL_SOCKET, 32, int(sys.argv[5]))
    conn.settimeout(2)
    try:
        conn.connect((sys.argv[1], int(sys.argv[2])))
        break
    except OSError:
        conn.close()
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
                 timeout: float = 60.0, port: int = 5201, *, sockbuf: int = 0,
                 skip_s: float = 0.0) -> float:
    """Goodput in Mbit/s of one TCP stream carrying `nbytes` from `sender` to `receiver`,
    counted from the first byte received, or from `skip_s` seconds after it (past slow
    start). `sockbuf` (bytes, 0: the kernel's autotuning) sizes both ends' buffers."""
    args = [bed.addr(receiver), str(port)]
    recv = bed.popen(receiver, [sys.executable, "-c", _RECEIVER, *args, str(timeout),
                                str(sockbuf), str(skip_s)],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        bed.run(sender, [sys.executable, "-c", _SENDER, *args, str(nbytes), str(timeout),
                         str(sockbuf)],
                timeout=timeout, check=True, capture_output=True)
        out, err = recv.communicate(timeout=timeout)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(timeout=5)
    if recv.returncode != 0:
        raise TestbedError(f"throughput receiver on {receiver} failed: {err.strip()[-300:]}")
    got, seconds, counted = out.split()
    if int(got) != nbytes:
        raise TestbedError(f"throughput: received {got} of {nbytes} bytes")
    return int(counted) * 8 / float(seconds) / 1e6


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
                     forever: bool = False, nat: Iterable[str] = (),
                     **links: Any) -> Iterator[tuple[Testbed, Any]]:
    """A test bed with hosts `bootstrap` (uncapped: DHT only) and `node-0..` (at `rate_mbit`),
    and a not yet started `LocalSwarm` of `nodes` nodes placed on them; both torn down after.
    `hosts` (default `nodes`) adds spare node hosts, for nodes started later; the hosts
    named in `nat` sit behind a NAT router each (no port forwards); `links` (`delays`,
    `jitter`, `loss`, `emulate`, `seed`) go to the `Testbed`."""
    from dilonode.cli.local_swarm import LocalSwarm

    names = ["bootstrap", *(f"node-{i}" for i in range(hosts or nodes))]
    with Testbed(names, rate_mbit, rates={"bootstrap": None}, nat=nat, **links) as bed:
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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="WAN test bed: namespaces, a bridge, tbf limits")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a test bed and hold it until Ctrl+C")
    up.add_argument("--hosts", type=int, default=3, help="number of hosts")
    up.add_argument("--rate", type=float, default=None, help="Mbit/s each way per host")
    up.add_argument("--subnet", default=None,
                    help=f"default {PRIVATE_SUBNET}, with NAT hosts {PUBLIC_SUBNET}")
    up.add_argument("--nat", type=int, default=0,
                    help="put the last N hosts behind a NAT router each")
    up.add_argument("--delay", type=float, default=None,
                    help="one-way ms of each host's access link (round trip: 4x)")
    up.add_argument("--jitter", type=float, default=None, help="ms, each access link")
    up.add_argument("--loss", type=float, default=None,
                    help="share of packets lost each way on each access link")
    sub.add_parser("sweep", help="remove leftovers of test beds whose owner died")
    check = sub.add_parser("check", help="say whether a test bed can be built here")
    check.add_argument("--nat", action="store_true", help="with NAT hosts")
    check.add_argument("--delay", action="store_true", help="with the link emulator")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "check":
        reason = unavailable_reason(nat=args.nat, delay=args.delay)
        print(reason or "ok")
        return 1 if reason else 0
    if args.cmd == "sweep":
        print("\n".join(sweep()) or "nothing to remove")
        return 0
    names = [f"h{i}" for i in range(args.hosts)]
    natted = names[max(args.hosts - args.nat, 0):]
    links = {arg: {n: value for n in names}
             for arg, value in (("delays", args.delay), ("jitter", args.jitter),
                                ("loss", args.loss)) if value is not None}
    with Testbed(names, args.rate, args.subnet, nat=natted, **links) as bed:
        for h in bed.hosts.values():
            behind = f", behind NAT {h.public_addr} (router netns {h.router})" if h.router else ""
            print(f"{h.name}: {h.addr} (netns {h.netns}, {h.rate_mbit or 'no'} Mbit/s cap"
                  f"{behind}, {h.link})")
        print(f"run inside a host: ip netns exec {next(iter(bed.hosts.values())).netns} CMD")
        print("Ctrl+C tears it down")
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
