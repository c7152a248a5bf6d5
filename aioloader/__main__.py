"""Command line: `python -m aioloader profile MODULE:FACTORY`, `python -m aioloader manifest URL -o FILE`.

`profile` calls FACTORY() (a function of MODULE, a module name or a path to a .py file, that returns a
Loader), draws `--batches` batches from it with a progress bar, then prints the stats table and the
verdict of `loader.diagnose()`, and saves throughput and occupancy over time as a PNG.

`manifest` lists the objects under URL (s3://, gs:// or az://; credentials as the sources find them)
once and writes their keys, sizes and ETags to FILE, for a source's `manifest=` argument.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._loader import Loader
from ._observe.profile import MATPLOTLIB_MISSING, SAMPLE_INTERVAL_S, Sampler, draw, plot


def _factory(spec: str) -> Callable[[], Any]:
    """MODULE:FACTORY -> the function; MODULE is a dotted name (found from the cwd) or a .py path."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"aioloader: expected MODULE:FACTORY, got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        loaded = importlib.util.spec_from_file_location(path.stem, path)
        if loaded is None or loaded.loader is None or not path.exists():
            raise SystemExit(f"aioloader: no such file: {module_name}")
        module = importlib.util.module_from_spec(loaded)
        sys.modules[path.stem] = module
        loaded.loader.exec_module(module)
    else:
        sys.path.insert(0, str(Path.cwd()))
        module = importlib.import_module(module_name)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise SystemExit(f"aioloader: {module_name} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m aioloader", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("profile", help="run a loader, print its stats and its bottleneck")
    p.add_argument("factory", metavar="MODULE:FACTORY", help="a function that returns a Loader")
    p.add_argument("--batches", type=int, default=100, help="batches to draw (default 100)")
    p.add_argument("--interval", type=float, default=SAMPLE_INTERVAL_S,
                   help=f"seconds between stats samples (default {SAMPLE_INTERVAL_S})")  # fmt: skip
    p.add_argument("--png", default="aioloader-profile.png", help="where to save the plot")
    p.add_argument("--no-png", action="store_true", help="do not plot")
    p.add_argument("--trace", help="also write a Perfetto/Chrome trace to this path")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    m = commands.add_parser("manifest", help="list a prefix once, write its manifest")
    m.add_argument("url", help="s3://bucket/prefix, gs://bucket/prefix or az://container/prefix")
    m.add_argument("-o", "--output", required=True, help="the manifest file to write")
    m.add_argument("--endpoint-url", help="the store's endpoint (an emulator, S3-compatible store)")
    m.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="another argument of the source (a string), e.g. region=eu-west-1")  # fmt: skip
    return parser


def manifest(args: argparse.Namespace) -> int:
    from . import sources

    makers: dict[str, Callable[..., sources.S3 | sources.GCS | sources.Azure]] = {
        "s3": sources.s3, "gs": sources.gcs, "az": sources.azure,
    }  # fmt: skip
    scheme = args.url.partition("://")[0]
    if scheme not in makers:
        print(f"aioloader: url must start with s3://, gs:// or az://, got {args.url!r}")
        return 2
    options: dict[str, Any] = dict(o.partition("=")[::2] for o in args.option)
    if args.endpoint_url:
        options["endpoint_url"] = args.endpoint_url
    source = makers[scheme](args.url, **options)
    listed = source.manifest()
    path = listed.write(args.output)
    size = path.stat().st_size
    print(f"{len(listed.keys)} objects under {listed.where}: {path} ({size} bytes)")
    return 0


def profile(args: argparse.Namespace) -> int:
    loader = _factory(args.factory)()
    if not isinstance(loader, Loader):
        print(f"aioloader: {args.factory} returned {type(loader).__name__}, not a Loader")
        return 2
    with loader:
        trace = loader.trace(args.trace) if args.trace else None
        with Sampler(loader, args.interval) as sampler:
            drawn = sum(1 for _ in draw(loader, args.batches, progress=not args.no_progress))
        print(f"{drawn} batches\n")
        print(loader.stats().table())
        print()
        print(loader.diagnose())
        if trace is not None:
            trace.close()
            print(f"\ntrace: {trace.path}")
    if not args.no_png:
        saved = plot(sampler.samples, args.png)
        print(f"plot: {saved}" if saved is not None else MATPLOTLIB_MISSING)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return manifest(args) if args.command == "manifest" else profile(args)


if __name__ == "__main__":
    sys.exit(main())
