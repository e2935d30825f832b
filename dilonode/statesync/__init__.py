"""Live state recovery: a joining node fetches the swarm's outer state from its peers.

`protocol` holds the wire messages and framing, `plan` the pure parts (manifests, choosing
the state to trust, scheduling chunks over peers, assembling), `link` the authenticated
connection (handshake and per-frame MACs), `service` the TCP server every node runs and the
joiner's `recover()`. See protocol/README.md, "State sync".
"""
