"""Settings of the test process itself.

The simulator and the in-process checks train the nano model (39k parameters), whose ops
run faster on one thread than split over the cores: a 4-worker simulation of 150 steps took
4.9 s against 6.9 s with torch's default 2 threads on the 2-core box, with identical
results. Nodes, which are child processes, get their share of the cores from `LocalSwarm`.
"""

import torch

torch.set_num_threads(1)
