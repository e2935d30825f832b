"""Swarm layer: peer discovery and matchmaking over a hivemind DHT.

`records` holds the pure data published in the DHT, `dht.SwarmDHT` the node's DHT handle,
and `matchmaking.form_group` the agreement on who averages a fragment round together.
Importing this package is cheap: hivemind is imported only when a `SwarmDHT` starts.
"""
