"""Where objects live, each as a source: local files, fsspec, HTTP(S), S3, GCS and Azure Blob, with
each store's credentials and signing, and the paged listing the bucket stores share.

The stores are built on the transport (and the cache); they know no format.
"""
