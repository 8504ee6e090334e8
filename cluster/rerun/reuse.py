"""Reuse: a run whose work key (cluster/rerun/work_key.py) matches a FINISHED run of its experiment does not train
again; it points at that run. A run that differs from a FINISHED run only in more `train.epochs` continues it: it
starts from that run's last checkpoint (what its loop's ray.train.get_checkpoint() returns) and trains the epochs
left. The flow asks `finished_twin` once its spec is valid, before the quota or a cluster.

    reuse: never             in a spec: its runs always train (a schedule that wants a fresh run every night)
    gpuflow run --force      one run trains from scratch (also --from-scratch; the flow's `force` parameter, a switch
                             in the Prefect UI form)
    GPUFLOW_REUSE=never      this machine's runs always train (the test suite's default, as GPUFLOW_STACK=manual)

A rerun (`gpuflow rerun`) always trains: reproducing a run is its point.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuflow.cluster.config import REUSE_ENV, reuse_mode
from gpuflow.cluster.lineage import source_tags, uncommitted_changes
from gpuflow.cluster.protocol import CHECKPOINT_TAG
from gpuflow.cluster.rerun.work_key import WorkKey, finished_run_with_key, run_to_continue, work_key
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.util.local_store import store_exists


@dataclass(frozen=True)
class Twin:
    """What the reuse check found: the finished run to point at (None: train), and why, for the run's log; or the
    finished run of fewer epochs to continue, and its last checkpoint."""

    run: object | None  # an MLflow Run
    why: str
    continues: object | None = None  # an MLflow Run: the one the run continues
    checkpoint: str | None = None  # its last checkpoint, where the run starts
    epochs_left: int | None = None  # what the run then trains


def finished_twin(spec: ExperimentSpec, force: bool = False) -> Twin:
    """The newest FINISHED run of the spec's experiment with this spec's work key, or why the run trains."""
    if off := reuse_off(spec, force):
        return Twin(None, off)
    key = key_here(spec)
    if key.key is None:
        return Twin(None, f"never reused: {key.missing}")
    if not store_exists(spec.tracking_uri):  # no run there yet; opening it would create it
        return Twin(None, f"no finished run has its work key {key.key[:12]}: its tracking store is new")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=spec.tracking_uri)
    try:
        experiment = client.get_experiment_by_name(spec.experiment_name)
        found = finished_run_with_key(client, experiment.experiment_id, key.key) if experiment else None
        if found is not None:
            why = f"the finished run {found.info.run_name} ({found.info.run_id}) has its work key {key.key[:12]}"
            return Twin(found, why)
        if experiment and spec.sweep is None and (earlier := continuation(client, experiment.experiment_id, key, spec)):
            return earlier
    except Exception as exc:  # the tracking server refuses or is down: opening the run says how, with its retries
        return Twin(None, f"could not look for a finished run ({type(exc).__name__}: {str(exc)[:200]})")
    return Twin(None, f"no finished run has its work key {key.key[:12]}")


def reuse_off(spec: ExperimentSpec, force: bool = False) -> str | None:
    """Why the run trains whatever ran before (a sweep's trials too); None where reuse is on."""
    if force:
        return "--force: trains from scratch, whatever ran before"
    if spec.reuse == "never" or reuse_mode() == "never":
        return "reuse is off (reuse: never)" if spec.reuse == "never" else f"reuse is off ({REUSE_ENV})"
    return None


def continuation(client, experiment_id: str, key: WorkKey, spec: ExperimentSpec) -> Twin | None:
    """The run continues a FINISHED run of the same work but fewer epochs, from its last checkpoint, when that
    checkpoint can still be read; None where there is none."""
    earlier = run_to_continue(client, experiment_id, key.without_epochs, spec.train.epochs)
    checkpoint = earlier.data.tags.get(CHECKPOINT_TAG) if earlier else None
    if not checkpoint or not readable(checkpoint):
        return None
    epoch = int(earlier.data.tags.get(CHECKPOINT_TAG + "_step", -1))
    left = spec.train.epochs - epoch - 1
    return Twin(
        None,
        f"continues the finished run {earlier.info.run_name} ({earlier.info.run_id}) from its checkpoint of epoch "
        f"{epoch}: {left} epoch(s) to train (--force trains from scratch)",
        earlier,
        checkpoint,
        left,
    )


def readable(uri: str) -> bool:
    """The checkpoint folder is there (any pyarrow filesystem: a local path, s3://, gs://)."""
    import pyarrow.fs

    try:
        filesystem, path = pyarrow.fs.FileSystem.from_uri(uri if "://" in uri else f"file://{uri}")
        return filesystem.get_file_info(path).type == pyarrow.fs.FileType.Directory
    except Exception:  # no credentials here, a bucket gone: start from scratch rather than fail in the job
        return False


def key_here(spec: ExperimentSpec) -> WorkKey:
    """The work key the run's MLflow run would record (tasks/tracking.py open_mlflow_run reads the same inputs)."""
    changes, diff = uncommitted_changes(spec.workdir)
    return work_key(spec, {**source_tags(spec.workdir), **changes}, diff)
