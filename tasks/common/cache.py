"""How a stage is cached: on the key of its inputs, and only while what its record names is still
there. Every stage's manifest says whether its outputs are intact (``intact()``); a record whose
outputs are gone or damaged gives no key, so the stage runs again, from a flow or from its own
command line alike (``cached``), and nothing outside the stage has to know how to tell."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from prefect.cache_policies import CachePolicy

from tasks.common.run_context import run_logger


class Recorded(Protocol):
    def intact(self) -> bool: ...


@dataclass
class StageCache(CachePolicy):
    """The stage's key from its inputs (``key_of``: the inputs by name, None for no key), absent
    while the record under it names outputs that are no longer intact."""
    key_of: Optional[Callable[[dict[str, Any]], Optional[str]]] = None

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> Optional[str]:
        store = getattr(task_ctx, "result_store", None)
        return self.key(inputs, store)

    def key(self, inputs: dict[str, Any], store: Any = None) -> Optional[str]:
        """The key, or None where the record under it names damaged or missing outputs."""
        from prefect.results import get_result_store

        try:
            key = self.key_of(inputs) if self.key_of is not None else None
        except Exception:   # inputs the stage itself refuses, with the clear error
            return None
        store = store or get_result_store()
        if key is None or not store.exists(key):
            return key
        try:
            intact = store.read(key).result.intact()
        except Exception:   # a record this version cannot read: made again
            intact = False
        if not intact:
            run_logger().info("the cached result's outputs are gone or damaged; running the stage again")
            return None
        return key


def cached(stage: Any, **inputs: Any) -> tuple[Any, bool]:
    """A stage task called from its own command line, without a Prefect server: its record under
    the stage's own cache key when that is there and intact, else the stage run and its result
    recorded, where a flow run on this machine records it. Returns the result and whether it came
    from the cache."""
    from prefect.utilities.callables import get_call_parameters

    inputs = get_call_parameters(stage.fn, (), inputs)       # with its defaults, as a flow run names them
    store = result_store().update_for_task(stage, _sync=True)
    key = stage.cache_policy.key(inputs, store)
    if key is not None and store.exists(key):
        return store.read(key).result, True
    result = stage.fn(**inputs)
    if key is not None:
        store.write(result, key=key)
    return result, False


def result_store() -> Any:
    """Where results are recorded: the Prefect server's default when one is named (PREFECT_API_URL)
    or a storage block is set, else this machine's local storage path, as a flow run with a
    temporary server keeps them (asking for the server's default would start one)."""
    from prefect.filesystems import LocalFileSystem
    from prefect.results import ResultStore, get_result_store
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url or settings.results.default_storage_block:
        return get_result_store()
    return ResultStore(result_storage=LocalFileSystem(basepath=str(settings.results.local_storage_path)))
