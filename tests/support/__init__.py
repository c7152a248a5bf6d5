"""What the tests share: real servers started on 127.0.0.1 (SeaweedFS for S3, fake-gcs-server,
Azurite, an HTTP origin and a proxy that injects faults), their pytest fixtures, and fakes (a
tracking fetch, a CUDA seam, a profile factory). `tests/` is on `sys.path` (pytest puts the
root conftest's folder there; the benchmarks that start a server put it there themselves)."""
