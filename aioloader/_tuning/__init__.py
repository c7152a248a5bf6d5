"""Limits that move or hold: the bounds an epoch keeps, and the climbers that tune concurrency and workers."""
