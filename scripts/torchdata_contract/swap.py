"""pytest plugin: torchdata's StatefulDataLoader tests run against `aioloader.StatefulDataLoader`.

Loaded by `make test-torchdata` (`-p swap`) before the test modules import
`torchdata.stateful_dataloader.StatefulDataLoader`, it puts aioloader's class in its place; the tests
themselves are torchdata's, unchanged.
"""

import torchdata.stateful_dataloader as torchdata_sdl

import aioloader

torchdata_sdl.StatefulDataLoader = aioloader.StatefulDataLoader
