"""aioloader: an asyncio data loader for PyTorch.

One event loop fetches samples concurrently; a pool decodes them; batches are collated into recycled
buffers and handed to `for batch in loader` or `async for batch in loader`.
"""

from . import sources as sources
from ._exceptions import AioloaderError as AioloaderError
from ._exceptions import CollateError as CollateError
from ._exceptions import DecodeError as DecodeError
from ._exceptions import FetchError as FetchError
from ._exceptions import InvalidKeyError as InvalidKeyError
from ._exceptions import LoaderClosedError as LoaderClosedError
from ._exceptions import LoaderTimeout as LoaderTimeout
from ._exceptions import NumWorkersChanged as NumWorkersChanged
from ._exceptions import SampleError as SampleError
from ._exceptions import StateError as StateError
from ._exceptions import WorkerDied as WorkerDied
from ._exceptions import WorkerTimeout as WorkerTimeout
from ._executors.base import Executor as Executor
from ._executors.process.executor import ProcessExecutor as ProcessExecutor
from ._loader import DEFAULT_COLLATE as DEFAULT_COLLATE
from ._loader import Loader as Loader
from ._mix.choices import Schedule as Schedule
from ._mix.choices import schedule as schedule
from ._mix.loaders import MixedLoaders as MixedLoaders
from ._mix.mix import mix as mix
from ._mix.rows import MixedRows as MixedRows
from ._mix.source import Mix as Mix
from ._mix.source import MixKey as MixKey
from ._observe.diagnose import Diagnosis as Diagnosis
from ._observe.stats import LoaderStats as LoaderStats
from ._observe.stats import StageStats as StageStats
from ._observe.trace import Trace as Trace
from ._pack.packed import Packed as Packed
from ._pack.packed import pack as pack
from ._pack.tokenize import Tokenize as Tokenize
from ._pack.tokenize import tokenize as tokenize
from ._pipeline.collate import BufferPool as BufferPool
from ._pipeline.collate import default_collate as default_collate
from ._resume.dcp import DataCheckpoint as DataCheckpoint
from ._util.rng import sample_generator as sample_generator
from ._util.rng import sample_np_generator as sample_np_generator
from ._util.rng import sample_seed as sample_seed
from .dataloader import DataLoader as DataLoader
from .dataloader import StatefulDataLoader as StatefulDataLoader

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_COLLATE",
    "AioloaderError",
    "BufferPool",
    "CollateError",
    "DataCheckpoint",
    "DataLoader",
    "DecodeError",
    "Diagnosis",
    "Executor",
    "FetchError",
    "InvalidKeyError",
    "Loader",
    "LoaderClosedError",
    "LoaderStats",
    "LoaderTimeout",
    "Mix",
    "MixKey",
    "MixedLoaders",
    "MixedRows",
    "NumWorkersChanged",
    "Packed",
    "ProcessExecutor",
    "SampleError",
    "Schedule",
    "StageStats",
    "StateError",
    "StatefulDataLoader",
    "Tokenize",
    "Trace",
    "WorkerDied",
    "WorkerTimeout",
    "default_collate",
    "mix",
    "pack",
    "sample_generator",
    "sample_np_generator",
    "sample_seed",
    "schedule",
    "sources",
    "tokenize",
]
