"""One torchrun rank: join the gloo group, list an S3 prefix through `sources.s3`, write what it got.

argv: OUT_DIR ENDPOINT URL ACCESS SECRET. Writes OUT_DIR/rank{R}.json: the keys and the sizes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from aioloader import sources


def main() -> None:
    out, endpoint, url, access, secret = sys.argv[1:6]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    src = sources.s3(url, endpoint_url=endpoint, credentials=(access, secret), page_size=10)
    keys = src.keys()
    assert isinstance(keys, list)
    record = {
        "keys": keys,
        "sizes": [src.size(k) for k in keys],
        "etags": [src.etag(k) for k in keys],
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
