"""Simulators over the same algorithm code the daemon runs: the training simulator
(`training`: M virtual workers through `Worker`), the in-process collective they average
over (`local_group.LocalGroup`), and the swarm-scale model of bounded groups
(`swarm_scale`: hundreds or thousands of nodes, real rounds over an in-memory network)."""
