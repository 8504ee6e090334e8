"""A rerun the flow is asked for (run_experiment's rerun_of: the Prefect UI's rerun field): the spec of the run as it
ran, prepared as `gpuflow rerun` prepares it (plan.py), within the deployment's form_policy. Once prepared, the rerun
runs as any run does.

    used by flows/experiment.py, after the spec the form asked for is read (flows/run_spec.py)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpuflow.cluster.spec import ExperimentSpec, parse_spec
from gpuflow.cluster.spec.form_policy import FormPolicy


def prepare_rerun(
    rerun_of: str, asked: ExperimentSpec, policy: FormPolicy | None, stamp_of: Callable[[str], str | None]
) -> ExperimentSpec:
    """The run `rerun_of` (an MLflow or Prefect flow run id, the UI's rerun field) as it ran, prepared as `gpuflow
    rerun` prepares it: its commit and changes checked out, its data checked, looked up in `asked`'s tracking store,
    its code checked against what its flow run recorded (stamp_of: a flow run's source stamp).
    A deployment with a form_policy reruns only what its form could have run (its workdir aside: the rerun's is the
    checkout), from committed code its repository's rerun_refs contain: nothing that MLflow alone holds runs on the
    worker. A spec `gpuflow rerun` prepared, whose workdir is a rerun's checkout already, runs as given."""
    from gpuflow.cluster.rerun.plan import Ask, prepare

    cache = rerun_cache()
    if Path(asked.workdir).expanduser().resolve().is_relative_to(cache.resolve()):
        return asked
    ask = Ask(rerun_of, [asked.tracking_uri], stamp_of=stamp_of, rerun_refs=tuple(policy.rerun_refs) if policy else ())
    prepared = prepare(ask, Path(asked.workdir).expanduser(), cache)
    if policy:
        policy.enforce(parse_spec({**prepared.found.recorded_spec(), "workdir": policy.baseline.workdir}))
    return prepared.spec


def rerun_cache() -> Path:
    from gpuflow.cluster.config import state_dir

    return state_dir() / "reruns"
