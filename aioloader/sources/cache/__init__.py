"""The disk cache of remote objects and shards (`disk.Cache`): its files, index and held handles.

The lowest room of the sources: it knows nothing of HTTP, stores or formats; what it caches is handed
to it as bytes by the transport (objects) and the shard reader (whole shards).
"""
