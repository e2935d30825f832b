"""`GroupFormer`: the `FormGroup` a node's `NetworkCollective` asks for each attempt.

It sits the round out while our data listener is down (`sit_out.SitOut`), reaches out to
the public peers first when we are behind a NAT (so their streams to us find a direct
libp2p connection, not a limited relayed one), then forms the group through `Membership`
with what the worker's request says of our state (`GroupRequest`). Everything a round
needs comes down with the request; nothing here reads the trainer.
"""

from __future__ import annotations

import math
from typing import Any

from dilonode.collective import FormedGroup, GroupNotFormed, GroupRequest
from dilonode.node.sit_out import SitOut
from dilonode.swarm.membership import Membership

__all__ = ["GroupFormer"]


class GroupFormer:
    """Forms the groups of one node's rounds (see the module docstring). `tunnel`: the
    node's libp2p tunnel (`swarm.tunnel.Tunnel`), or None without `network.p2p_fallback`."""

    def __init__(self, membership: Membership, sit_out: SitOut, tunnel: Any = None) -> None:
        self.membership, self.sit_out, self.tunnel = membership, sit_out, tunnel

    async def form(self, request: GroupRequest) -> FormedGroup:
        if self.sit_out.away() is not None and \
                (away := await self.sit_out.wait_back(request.attempt)) is not None:
            raise GroupNotFormed(f"sitting this round out: {away}")  # do not register
        if self.tunnel is not None and self.tunnel.private:
            # Before we register: the public peers' streams to us must find a direct
            # libp2p connection, not a limited relayed one (swarm/tunnel.py).
            me = self.membership.dht.peer_id
            seen = self.membership.live_peers(max_age=math.inf)  # the last read
            await self.tunnel.reach_out(r.peer_id for r in seen
                                        if r.reachable and r.peer_id != me)
        return await self.membership.form(request)
