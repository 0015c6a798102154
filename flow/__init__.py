"""tidal.flow: the streaming store, the staleness-bounded workflow, placement and algorithms.

May import `tidal.hal` only.
"""
