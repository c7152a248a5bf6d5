"""`aioloader.mix`: several sources, or built loaders, interleaved in set proportions: `mix.py`
(`mix()`, and the rule a mix follows), `choices.py` (which source each position draws; the checks
of `weights` and `stop`), `parts.py` (each input as a part that gives its keys one pass at a
time), `source.py` (`Mix`: the mix as a source, its keys and fetch), `loaders.py`
(`Mixing`, what every mix of built loaders is; `MixedLoaders`: built loaders mixed whole),
`rows.py` (`MixedRows`: loaders of columnar items mixed row by row)."""
