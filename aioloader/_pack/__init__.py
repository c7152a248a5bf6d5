"""Packing token documents into fixed-length rows: `packed.py` (`pack`, `Packed`: the loader
wrapped, its state), `packer.py` (the vectorised cut into rows), `documents.py` (what a loader
may yield, as runs of tokens), `tokenize.py` (`tokenize`: text to tokens in the decode threads)."""
