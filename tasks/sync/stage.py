"""The sync and upload stages as Prefect tasks: cached on the listing, retried on network trouble."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from tasks.cluster.config import ClusterConfig
from tasks.cluster.jobs import ReturnedError, submit
from tasks.common.cache import StageCache
from tasks.common.retry import worth_retrying
from tasks.common.secrets import hide_in_logs
from tasks.sync.download import sync
from tasks.sync.listing import list_sources, listing_digest
from tasks.sync.manifest import SyncManifest
from tasks.sync.reach import Reach
from tasks.sync.remote import Remote, SyncError
from tasks.sync.uploader import upload


def _sync_cache_key(parameters: dict[str, Any]) -> str | None:
    """The source listing (keys, sizes, ETags; local files' stat stamps), the destination and `delete`.
    An intact local copy of an unchanged source is a cache hit; none with `verify_content`, which
    reads everything again."""
    if parameters.get("verify_content"):
        return None
    sources = parameters["sources"]
    given = parameters.get("remote") or Remote()
    dest = str(Path(parameters["dest"]).expanduser().absolute())
    objs = list_sources([sources] if isinstance(sources, str) else sources,
                        Remote.make(given.endpoint_url, given.no_sign_request, given.profile),
                        reach=Reach.make(parameters.get("allowed_roots"), dest))
    return "sync-" + listing_digest(objs, dest, bool(parameters.get("delete", False)))


_RETRIES = dict(retries=4, retry_delay_seconds=exponential_backoff(backoff_factor=10), retry_jitter_factor=0.5,
                retry_condition_fn=worth_retrying)


def upload_stage(folder: str, uri: str, *, remote: Remote = Remote(), exclude: tuple[str, ...] = ()) -> SyncManifest:
    """The run folder uploaded to ``uri`` (tasks.sync.uploader), reached as ``remote`` says."""
    return upload(folder, uri, exclude=exclude, **remote.options())


upload_task = task(upload_stage, name="upload", cache_policy=NO_CACHE, **_RETRIES)


@dataclass(frozen=True)
class SyncJob:
    """``sync`` as a job runs it on a compute node. Its errors come back as its result (ReturnedError), and
    the flow's process raises them, so that network trouble is retried like the in-process stage's."""
    sources: list[str] | str
    dest: str
    options: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> SyncManifest | ReturnedError:
        hide_in_logs()
        try:
            return sync(self.sources, self.dest, **self.options)
        except SyncError as e:
            return ReturnedError(e)


def sync_on_cluster(sources: list[str] | str, dest: str, cluster: ClusterConfig, *, remote: Remote = Remote(),
                    allowed_roots: list[str] | None = None, verify_content: bool = False) -> SyncManifest:
    """``sync`` as one job on a node of the data partition (cluster preset ``data_jobs: true``): the
    bytes move over that node's link into shared storage, verified as in this process; this process
    lists, follows and reads the manifest. The job's record and log are in ``<dest>.jobs/``. The
    job gets no credential from this process's environment: it reads the node's own (an instance
    role, or the profile's files in a shared home)."""
    dest = str(Path(dest).expanduser().absolute())
    options = dict(**remote.options(), allowed_roots=allowed_roots, verify_content=verify_content)
    result, _, _ = submit(SyncJob(sources, dest, options), cluster.data_job(), run_dir=Path(dest + ".jobs"),
                          job_name="sync")
    if isinstance(result, ReturnedError):
        raise result.error
    return result


def sync_stage(sources: list[str] | str, dest: str, *, cluster: ClusterConfig | None = None, remote: Remote = Remote(),
               allowed_roots: list[str] | None = None, verify_content: bool = False) -> SyncManifest:
    """The stage as the flow runs it: in this process, or as one job on the cluster's data partition
    when its preset says ``data_jobs: true``; the same copy and manifest either way."""
    if cluster is not None and cluster.data_jobs:
        return sync_on_cluster(sources, dest, cluster, remote=remote, allowed_roots=allowed_roots,
                               verify_content=verify_content)
    return sync(sources, dest, allowed_roots=allowed_roots, verify_content=verify_content, **remote.options())


sync_task = task(sync_stage, name="sync", cache_policy=StageCache(key_of=_sync_cache_key), persist_result=True,
                 **_RETRIES)
