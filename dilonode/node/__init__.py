"""A training node: the composition root (`daemon.Node`: DHT, data plane, trainer, state
keeping and status wired together) and the supervision of its long-lived parts
(`supervisor`, `supervised_parts`)."""
