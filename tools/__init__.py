"""tidal.tools: the `tidal` command line, recipe configuration, benchmarks and the simulator."""
