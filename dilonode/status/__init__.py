"""Operating a node: its read-only HTTP status endpoint, Prometheus metrics and dashboard.

* `snapshot.NodeStatus`  what a training node is doing (recorded by the trainer, read by all)
* `swarm.SwarmView`      the bootstrap's view of every node, from the DHT peer records
* `metrics`              Prometheus text exposition of either snapshot
* `server.StatusServer`  aiohttp server of `/`, `/status`, `/history`, `/metrics`
* `table`                the terminal tables of `dilonode status`
* `dashboard.html`       the page served at `/` (package data, no external resources)

Importing this package imports nothing heavy; import the submodule you need.
"""

__all__: list[str] = []
