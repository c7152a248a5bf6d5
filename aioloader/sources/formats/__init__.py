"""Samples inside files, as sources: WebDataset tar shards and Parquet row groups.

A format reads its files from any store (by URL scheme), so it sits above the stores and the
transport.
"""
