"""One flow run's state, built once and handed to each step of the flow: what it runs (the spec), as which Prefect
flow run, its MLflow record, the lifecycle that owns its cluster's end (and the meter), capacity, the webhook."""

from __future__ import annotations

from dataclasses import dataclass

from gpuflow.cluster.backends import Backend, Job, cluster_name_for, get_backend, train_run_name
from gpuflow.cluster.config import metadata_url
from gpuflow.cluster.cost.pricing import hourly_cost
from gpuflow.cluster.protocol import JobEnv
from gpuflow.cluster.run.lifecycle import Lifecycle
from gpuflow.cluster.run.meter import Meter
from gpuflow.cluster.run.record import RunRecord, run_url
from gpuflow.cluster.run.webhook import for_the_job
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.flows.capacity.waiting import Capacity
from gpuflow.flows.quota.hold import QuotaHold
from gpuflow.flows.run_tags import prefect_link


@dataclass
class ExperimentRun:
    spec: ExperimentSpec
    flow_run: dict  # id, name, url, deployment, created_by (this_flow_run); rerun_of, continues, continue_from
    webhook: dict | None  # the spec's notify.block, loaded: the job sends with it too
    record: RunRecord
    life: Lifecycle
    capacity: Capacity
    backend: Backend

    @classmethod
    def begin(cls, spec: ExperimentSpec, flow_run: dict, webhook: dict | None, quota: QuotaHold) -> ExperimentRun:
        """The run's records, before its cluster is requested: the bill counts from here. quota: its turn for the
        GPUs (flows/quota/hold.py), held."""
        record, backend = RunRecord(spec, flow_run["id"]), get_backend(spec.compute.backend)
        life = Lifecycle(
            cluster_name_for(flow_run["id"]),
            backend.down,
            Meter(hourly_cost(spec)),
            lambda outcome, bill: record.close(outcome, bill, life.meter.all_attempts(life.ended_at)),
            workers=spec.compute.num_workers,
        )
        return cls(spec, flow_run, webhook, record, life, Capacity(record, life, quota=quota), backend)

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id, once it is open."""
        return self.record.run_id

    def job(self) -> Job:
        """The training job: Ray Train's run name (the checkpoints' folder, stable for the flow run) and what the job
        needs to log into the MLflow run and to enforce the run's limits and lease on its own, should the flow die
        (and to say so, to the run's webhook)."""
        env = JobEnv(
            tracking_uri=self.spec.tracking_uri,
            mlflow_run_id=self.record.run_id,
            artifact_uri=self.record.artifact_uri,
            requested_at=self.life.requested_at,
            hourly_usd=self.life.meter.hourly_usd(),
            notify_json=self.notify_json(),
            metadata_url=metadata_url(),
            continue_from=self.flow_run.get("continue_from"),
        )
        return Job(train_run_name(self.spec.name, self.record.flow_run_id), env.to_env())

    def notify_json(self) -> str | None:
        """What the job needs to send the run's messages itself, should the flow die."""
        if self.webhook is None:
            return None
        return for_the_job(
            self.webhook,
            self.flow_run["name"],
            run_url(self.spec, self.run_id),
            prefect_link(self.flow_run["id"], self.flow_run["url"]),
        )
