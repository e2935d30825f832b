"""Swarm layer: peer discovery and matchmaking over a hivemind DHT.

`records` holds the pure data published in the DHT, `dht.SwarmDHT` the node's DHT handle,
and `matchmaking.form_group` the agreement on who averages a fragment round together.
Importing this package is cheap: hivemind is imported only when a `SwarmDHT` starts.
"""

from dilonode.swarm.dht import RawEntry, SwarmDHT
from dilonode.swarm.matchmaking import Group, GroupBoard, MatchmakingError, form_group
from dilonode.swarm.records import (
    GroupEntry,
    PeerRecord,
    decode_record,
    encode_record,
    group_key,
    peers_key,
)

__all__ = [
    "Group",
    "GroupBoard",
    "GroupEntry",
    "MatchmakingError",
    "PeerRecord",
    "RawEntry",
    "SwarmDHT",
    "decode_record",
    "encode_record",
    "form_group",
    "group_key",
    "peers_key",
]
