"""The torch-compatible DataLoader's parts: whole-batch workers, samplers as plans, argument checks."""
