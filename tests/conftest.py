"""Settings of the test process itself.

The simulator and the in-process checks train the nano model (39k parameters), whose ops
run faster on one thread than split over the cores: `dilonode.sim.training.simulate` on
tests/integration/test_churn.py's CFG with 4 workers and 150 steps took 4.9 s with
OMP_NUM_THREADS=1 against 6.9 s with torch's default 2 threads on the 2-core box, with the
same final loss. Nodes, which are child processes, get their share of the cores from
`LocalSwarm`.
"""

import torch

torch.set_num_threads(1)
