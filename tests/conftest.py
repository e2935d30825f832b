"""Settings of the test process itself.

The simulator and the in-process checks train the nano model (39k parameters), whose ops
run faster on one thread than split over the cores: `dilonode.sim.training.simulate` on
tests/integration/test_churn.py's CFG with 4 workers and 150 steps took 4.9 s with
OMP_NUM_THREADS=1 against 6.9 s with torch's default 2 threads on the 2-core box, with the
same final loss. Nodes, which are child processes, get their share of the cores from
`LocalSwarm`.

`make test` runs the suite in two pytest-xdist workers (`--dist loadgroup`): most tests wait
on timeouts, clocks and child processes more than they compute. Tests marked
`host_network` create namespaces, veth pairs, tc qdiscs or iptables rules with names and
ports of their own choosing, so they all go to one worker, one at a time.
"""

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("host_network") is not None:
            item.add_marker(pytest.mark.xdist_group("host_network"))
