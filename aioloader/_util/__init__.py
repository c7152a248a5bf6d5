"""Small tools every stage uses: thread pools, recycled bytearrays, seeds, ranges, checks, loops."""
