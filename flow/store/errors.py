"""The store's errors (`tidal.flow.store` exports them)."""


class StoreError(RuntimeError):
    """A store call that cannot be served; the message says why."""


class StoreTimeout(StoreError, TimeoutError):
    """`get` or `put` waited for its whole timeout."""
