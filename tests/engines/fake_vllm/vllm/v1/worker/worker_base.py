"""`WorkerBase` and the part of `WorkerWrapperBase` that mixes a worker extension in (vLLM 0.32.0)."""

from __future__ import annotations

import importlib
from typing import Any


class WorkerBase:
    """What every vLLM worker offers (the names a worker extension must not reuse)."""

    def init_device(self) -> None:
        raise NotImplementedError

    def load_model(self) -> None:
        raise NotImplementedError

    def get_model(self) -> Any:
        raise NotImplementedError

    def execute_model(self, scheduler_output: Any) -> Any:
        raise NotImplementedError

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


def resolve_obj_by_qualname(qualname: str) -> Any:
    module_name, obj_name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), obj_name)


def with_extension(worker_class: type, qualname: str) -> type:
    """`worker_class` with the extension named `qualname` after it in the lookup order, as vLLM
    appends it to the worker class's bases; vLLM's conflict check first (an extension name the
    worker class already has is an AssertionError)."""
    if not qualname:
        return worker_class
    extension = resolve_obj_by_qualname(qualname)
    for attr in dir(extension):
        if attr.startswith("__"):
            continue
        assert not hasattr(worker_class, attr), f"Worker class {worker_class} already has an attribute {attr}, which conflicts with the worker extension class {extension}."
    return type(worker_class.__name__, (worker_class, extension), {})
