"""The cost of one mechanism in one process (a codec, a frame, a reduction)."""
