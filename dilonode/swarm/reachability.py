"""Whether peers can dial this node (`network.reachable`), and what follows from it.

A volunteer behind a home router (NAT, no port forward) can dial out but cannot be dialled:
its data and state-sync listeners sit on a private address nobody outside its LAN reaches.
Such a node is *private*; everything else is *public*. `resolve(net)` decides:

* `public` / `private`: as configured.
* `auto` (the default): public when `network.announce_host` is set (the operator says where
  peers reach us: a public address or a forwarded port) or when we listen on loopback (a
  local swarm) or on an address that is not an IP literal (a host name: we cannot tell);
  private when we listen on a non-global address (RFC 1918, CGNAT, link-local) while an
  initial peer has a global one: we reach the swarm through a NAT. A swarm whose peers
  all sit on one private network (a LAN, a VPN, the WAN test bed) is public to itself.

What a private node does differently (`dht_options`, and the node for the rest):

* its DHT runs in client mode: it stores and reads records through the public peers but
  is never put in their routing tables, so nobody waits on a dial to it;
* its p2pd takes circuit-relay reservations at its initial peers (hivemind's
  `use_auto_relay` with those as `trusted_relays`, reachability forced private so it does
  not wait for AutoNAT), which makes it reachable by libp2p streams through them;
  `-relayDiscovery=0` makes those the only relays: with discovery on, go-libp2p's
  autorelay waits 3 minutes for at least 4 candidate relays before using fewer;
* its peer record says `reachable = False`: peers open a libp2p stream to it at once
  instead of dialling its data or state address first (`DataPlane.stream_only`,
  `recover(streamed=...)`), over a direct libp2p connection when p2pd holds one, else
  through a relay at their initial peers (`dilonode.swarm.tunnel`);
* it keeps direct libp2p connections to the public peers it averages with
  (`Tunnel.reach_out`), which they stream to it over.

hivemind's `P2P.create` has no parameter for `-relayDiscovery`; `add_p2pd_flags` adds it to
the daemon's command line in the process that starts p2pd (the DHT's own process).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Literal

__all__ = ["Reachability", "add_p2pd_flags", "dht_options", "resolve"]

log = logging.getLogger(__name__)

Reachability = Literal["public", "private"]


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


def _maddr_ips(maddrs: Iterable[str]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP literals in multiaddrs (/ip4/1.2.3.4/tcp/..., /ip6/...); DNS names skipped."""
    out = []
    for maddr in maddrs:
        parts = maddr.split("/")
        for proto, value in zip(parts, parts[1:], strict=False):
            if proto in ("ip4", "ip6") and (ip := _ip(value)) is not None:
                out.append(ip)
    return out


def resolve(setting: str, host: str, announce_host: str | None,
            initial_peers: Iterable[str]) -> Reachability:
    """`network.reachable` for this node (see the module docstring for `auto`)."""
    if setting in ("public", "private"):
        return setting  # type: ignore[return-value]
    if setting != "auto":
        raise ValueError(f"network.reachable = {setting!r}: expected auto, public or private")
    if announce_host:
        return "public"
    own = _ip(host)
    if own is None or own.is_loopback or own.is_unspecified or own.is_global:
        return "public"
    if any(ip.is_global for ip in _maddr_ips(initial_peers)):
        return "private"
    return "public"


def dht_options(reach: Reachability,
                initial_peers: Iterable[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(keyword arguments for hivemind's DHT and P2P.create, extra p2pd flags) for a node
    of this reachability; a public node keeps hivemind's defaults."""
    relays = list(initial_peers)
    if reach == "public":
        return {}, {}
    if not relays:
        log.warning("network.reachable = private without initial peers: no relay to reserve "
                    "a slot at, so peers cannot open streams to this node")
        return {"client_mode": True}, {}
    return ({"client_mode": True, "use_auto_relay": True, "force_reachability": "private",
             "trusted_relays": relays}, {"relayDiscovery": False})


def add_p2pd_flags(flags: Mapping[str, Any]) -> None:
    """Add `flags` to every p2pd this process starts with static relays (`trusted_relays`),
    by wrapping hivemind's `P2P._make_process_args`. Call it in the DHT's own process only.

    Daemons started without static relays (hivemind's check whether an identity is taken
    starts one) are left alone: p2pd refuses autorelay with neither discovery nor relays.
    """
    if not flags:
        return
    from hivemind.p2p import P2P

    make = P2P._make_process_args
    if getattr(make, "_dilonode_flags", None) == dict(flags):
        return

    def with_flags(*args: Any, **kwargs: Any) -> list[str]:
        if kwargs.get("trustedRelays"):
            kwargs = {**kwargs, **flags}
        return list(make(*args, **kwargs))

    with_flags._dilonode_flags = dict(flags)  # type: ignore[attr-defined]
    P2P._make_process_args = staticmethod(with_flags)
