"""Token sequences from Parquet files on S3, packed into fixed-length batches for a language model.

Lists the .parquet objects under an S3 prefix and reads only their "tokens" column (a list of token
ids per document; the other columns' bytes are never fetched) with `sources.parquet`: row groups in
a new order every epoch, documents mixed by a shuffle buffer. The documents are joined, each followed
by an end-of-document token, and cut into rows of `--seq-len + 1` tokens by `aioloader.pack`
(`targets=True`: each row starts at the last token of the one before); `--batch` rows make one
(inputs, targets) pair of shape [batch, seq-len]. Credentials come from the usual AWS chain.
`--write-demo` first writes three small files under the prefix, so the example runs against any S3
endpoint you can write to (a local SeaweedFS or MinIO too).

Usage:
    python examples/parquet_text.py s3://BUCKET/PREFIX/ [--endpoint-url URL] [--write-demo]
        [--seq-len 64] [--batch 8]
    (the endpoint defaults to $AWS_ENDPOINT_URL, else AWS itself)
"""

from __future__ import annotations

import argparse
import io
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from aioloader import Loader, pack
from aioloader.sources import parquet, s3

EOD = 0  # the end-of-document token
FILES, DOCS_PER_FILE, VOCAB = 3, 200, 1000


def demo_files() -> dict[str, bytes]:
    """FILES Parquet files of DOCS_PER_FILE documents: id, source, tokens (ids 1..VOCAB-1)."""
    rng = np.random.default_rng(0)
    out = {}
    for f in range(FILES):
        lengths = rng.integers(5, 120, DOCS_PER_FILE)
        table = pa.table({
            "id": np.arange(f * DOCS_PER_FILE, (f + 1) * DOCS_PER_FILE),
            "source": [f"web-{f}"] * DOCS_PER_FILE,
            "tokens": [rng.integers(1, VOCAB, n, dtype=np.int32) for n in lengths],
        })  # fmt: skip
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=50, compression="zstd")
        out[f"docs-{f:04d}.parquet"] = buf.getvalue()
    return out


def write_demo(bucket: str, prefix: str, endpoint_url: str | None) -> None:
    """Put the demo files under s3://bucket/prefix with botocore's own client."""
    import botocore.config
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint_url, region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        config=botocore.config.Config(s3={"addressing_style": "path"}),
    )  # fmt: skip
    for name, body in demo_files().items():
        client.put_object(Bucket=bucket, Key=prefix + name, Body=body)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefix", help="s3://BUCKET/PREFIX/ holding the .parquet files")
    parser.add_argument("--endpoint-url", default=os.environ.get("AWS_ENDPOINT_URL"))
    parser.add_argument("--write-demo", action="store_true", help="first write 3 demo files")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    bucket, _, prefix = args.prefix.removeprefix("s3://").partition("/")
    if args.write_demo:
        write_demo(bucket, prefix, args.endpoint_url)
    objects = s3(args.prefix, endpoint_url=args.endpoint_url).keys()
    urls = [f"s3://{bucket}/{key}" for key in objects if key.endswith(".parquet")]
    if not urls:
        print(f"no .parquet files under {args.prefix}", file=sys.stderr)
        return 1
    docs = parquet(urls, ["tokens"], shuffle_buffer=100,
                   s3_options={"endpoint_url": args.endpoint_url})  # fmt: skip
    print(docs)
    # one document per sample; the loader reads row groups ahead and hands documents over in order
    loader = Loader(docs, batch_size=None, collate=None)
    with pack(loader, args.seq_len, batch_size=args.batch, eos=EOD, key="tokens", targets=True,
              drop_last=True) as packed:  # fmt: skip
        for epoch in range(2):
            batches = 0
            for rows in packed:
                inputs, targets = rows[:, :-1], rows[:, 1:]  # a model would train on these
                assert inputs.shape == targets.shape == (args.batch, args.seq_len)
                batches += 1
            stats = docs.stats()
            print(f"epoch {epoch}: {batches} batches of {args.batch}x{args.seq_len} tokens; "
                  f"{stats['row_groups_read']:.0f} row groups read so far, "
                  f"{stats['bytes_read'] / 1e3:.0f} kB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
