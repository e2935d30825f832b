"""Contract tests: one behaviour suite run against every transport the all-reduce round
can be driven over (the in-memory `MemNet` and real TCP `DataPlane`s on 127.0.0.1)."""
