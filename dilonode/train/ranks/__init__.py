"""One node on several local devices: how its ranks split a fragment (`slices`, pure index
arithmetic) and the ranks objects a `Worker` drives (`node_ranks`)."""
