"""tidal.engines: rollout, training and reward adapters behind small protocols.

May import `tidal.hal` and the interfaces of `tidal.flow`.
"""
