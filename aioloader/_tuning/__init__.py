"""Limits that move or hold: the bounds an epoch keeps, the byte budget's split, the controllers."""
