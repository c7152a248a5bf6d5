"""How the remote sources move bytes: GET with retries and deadlines (`client.Transport`), the fast
engine, response bodies and failures, backoff, SigV4 signing, redaction, and `remote.Remote`, the base
the remote sources share.

It may use the cache (a transport reads through one) and knows no store and no format.
"""
