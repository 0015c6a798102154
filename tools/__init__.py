"""tidal.tools: the `tidal` command line, recipe configuration, placement plans (`tidal plan`) and benchmarks."""
