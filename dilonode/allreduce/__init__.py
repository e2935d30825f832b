"""Butterfly all-reduce of one pseudo-gradient fragment among a group of peers.

`round` holds the sans-IO state machine (`AllReduceRound`), `memnet` an in-memory network
with fault injection that runs several rounds against each other in tests, `transport` the
asyncio TCP data plane and `driver` the glue (one round, retries, the `NetworkCollective`).
The asyncio modules are not imported here, so the sans-IO core stays import-light.
"""
