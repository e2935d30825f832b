"""The command line: argument parsing and dispatch (`main`), what each command runs
(`commands`), turning arguments into a validated run config (`args`), logging and progress
output (`logs`, `progress`), the local swarm (`local_swarm`), the launcher of a node's
local ranks (`launch_ranks`) and the process exit (`fast_exit`).

`dilonode --help` imports nothing heavy: `commands` is imported only to run a command."""
