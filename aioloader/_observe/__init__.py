"""Seeing inside a running loader: stats and their table, traces, the diagnosis, progress, profiles."""
