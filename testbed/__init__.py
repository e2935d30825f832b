"""The WAN test bed: real nodes in Linux network namespaces on one machine, behind rate
limits (`hosts`), with fault injection (`chaos`) and churn (`churn`). Needs root; tests and
benchmarks import it from the repository root (it is not part of the installed package)."""
