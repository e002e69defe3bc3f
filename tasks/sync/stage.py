"""The sync and upload stages as Prefect tasks: cached on the listing, retried on network trouble."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from tasks.sync.download import sync
from tasks.sync.listing import list_sources, listing_digest
from tasks.sync.manifest import local_copy_matches
from tasks.sync.reach import Reach
from tasks.sync.remote import Remote, TransientSyncError
from tasks.sync.uploader import upload


def _retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry only errors that running again can fix (network, interruption, changed objects)."""
    try:
        state.result()
    except TransientSyncError:
        return True
    except BaseException:
        pass
    return False


def _sync_cache_key(context: Any, parameters: dict[str, Any]) -> str | None:
    """The source listing (keys, sizes, ETags; local files' stat stamps), the destination and `delete`.

    An intact local copy of an unchanged source is a cache hit. When a record exists for this key
    but the local copy no longer matches it (files damaged or removed), no key is given, so the
    sync runs again and repairs it; so it does with `verify_content`, which reads everything again.
    """
    from prefect.results import get_result_store
    if parameters.get("verify_content"):
        return None
    try:
        sources = parameters["sources"]
        remote = Remote.make(parameters.get("endpoint_url"), parameters.get("no_sign_request", False),
                             parameters.get("profile"))
        dest = str(Path(parameters["dest"]).expanduser().absolute())
        objs = list_sources([sources] if isinstance(sources, str) else sources, remote,
                            reach=Reach.make(parameters.get("allowed_roots"), dest))
    except Exception:
        return None                      # the sync itself will raise the clear error
    key = "sync-" + listing_digest(objs, dest, bool(parameters.get("delete", False)))
    if local_copy_matches(dest, objs) or not get_result_store().exists(key):
        return key
    return None


_RETRIES = dict(retries=4, retry_delay_seconds=exponential_backoff(backoff_factor=10), retry_jitter_factor=0.5,
                retry_condition_fn=_retry_transient)


sync_task = task(sync, name="sync", cache_key_fn=_sync_cache_key, persist_result=True, **_RETRIES)


upload_task = task(upload, name="upload", cache_policy=NO_CACHE, **_RETRIES)
