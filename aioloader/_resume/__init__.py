"""Exact resume: where an epoch stands, its saved state, and the loader's side of continuing it."""
