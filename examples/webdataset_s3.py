"""A WebDataset set (tar shards of `<key>.png` + `<key>.cls`) read from S3: training and validation.

Lists the .tar objects under an S3 prefix, trains on all but the last shard (shard order shuffled
every epoch, samples mixed by a shuffle buffer) and validates on the last one with `shuffle=False`
(the stored order, the same every epoch). Credentials come from the usual AWS chain (environment
variables, ~/.aws, ...). `--write-demo` first writes four small shards under the prefix, so the
example runs against any S3 endpoint you can write to (a local SeaweedFS or MinIO too).

Usage:
    python examples/webdataset_s3.py s3://BUCKET/PREFIX/ [--endpoint-url URL] [--write-demo]
    (the endpoint defaults to $AWS_ENDPOINT_URL, else AWS itself)
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
from typing import Any

import numpy as np
import torch
from PIL import Image

from aioloader import Loader
from aioloader.sources import s3, tar_shards

SHARDS, PER_SHARD, SIDE = 4, 24, 8


def decode(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """One WebDataset sample (a dict of its members' bytes) -> (3xHxW float image, label)."""
    with Image.open(io.BytesIO(sample["png"])) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255
    return torch.from_numpy(pixels).permute(2, 0, 1), int(sample["cls"])


def demo_shards() -> dict[str, bytes]:
    """SHARDS tar files of PER_SHARD samples each: `<key>.png` (brightness = label) and `<key>.cls`."""
    shards = {}
    for s in range(SHARDS):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            for i in range(PER_SHARD):
                label = (s * PER_SHARD + i) % 4
                png = io.BytesIO()
                Image.new("RGB", (SIDE, SIDE), (60 * label,) * 3).save(png, format="PNG")
                for ext, data in (("png", png.getvalue()), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"sample{s:02d}{i:03d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        shards[f"shard-{s:04d}.tar"] = out.getvalue()
    return shards


def write_demo(bucket: str, prefix: str, endpoint_url: str | None) -> None:
    """Put the demo shards under s3://bucket/prefix with botocore's own client."""
    import botocore.config
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint_url, region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        config=botocore.config.Config(s3={"addressing_style": "path"}),
    )  # fmt: skip
    for name, body in demo_shards().items():
        client.put_object(Bucket=bucket, Key=prefix + name, Body=body)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefix", help="s3://BUCKET/PREFIX/ holding the .tar shards")
    parser.add_argument("--endpoint-url", default=os.environ.get("AWS_ENDPOINT_URL"))
    parser.add_argument("--write-demo", action="store_true", help="first write 4 demo shards")
    args = parser.parse_args()
    bucket, _, prefix = args.prefix.removeprefix("s3://").partition("/")
    if args.write_demo:
        write_demo(bucket, prefix, args.endpoint_url)
    # the shards: every .tar object under the prefix (a listing, sorted)
    objects = s3(args.prefix, endpoint_url=args.endpoint_url).keys()
    urls = [f"s3://{bucket}/{key}" for key in objects if key.endswith(".tar")]
    if len(urls) < 2:
        print(
            f"need at least 2 .tar shards under {args.prefix}, found {len(urls)}", file=sys.stderr
        )
        return 1
    options = {"endpoint_url": args.endpoint_url}
    # training: shards shuffled every epoch (the default), samples mixed by a shuffle buffer
    train = tar_shards(urls[:-1], shuffle_buffer=32, s3_options=options)
    with Loader(train, decode=decode, batch_size=16, executor="thread", workers=2) as loader:
        print(loader)
        for epoch in range(2):
            samples = sum(len(labels) for _, labels in loader)
            print(f"train epoch {epoch}: {samples} samples")
    # validation: shuffle=False reads the shards in the order given, samples as stored
    val = tar_shards(urls[-1:], shuffle=False, s3_options=options)
    with Loader(val, decode=decode, collate=None, executor="inline") as loader:
        orders = [[label for _, label in loader] for _ in range(2)]
    if orders[0] != orders[1]:
        print("validation order changed between epochs", file=sys.stderr)
        return 1
    print(f"validation: {len(orders[0])} samples, the same order every epoch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
