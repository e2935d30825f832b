"""`python -m dilonode.cli`: the `dilonode` command (what `dilonode.cli.launch_ranks` and the
local swarm start their child processes with)."""

from dilonode.cli.main import entry

entry()
