"""A sweep's trials reused one by one: a grid point whose trial key matches a FINISHED run trains nothing. The sweep
records it as a child run pointing at that run (its values, its final metrics, `gpuflow.reused_run`), and only the
new points train; the best is chosen over both.

A trial's key is the work key (work_key.py) of the trial trained as a run of its own: the sweep's spec with the
point's values in place, the trial's workers (compute.num_workers), and no sweep section. So a trial matches a trial
of an earlier sweep, or a single run of the same training.

The flow writes the plan (`trial_plan`: each point, its key, the run that already trained it) as the parent run's
`sweep/trials.json` before the job starts; the job (cluster/job/sweep.py) trains the points the plan leaves, and
tags each trial with its key. Only a grid drawn once (`num_samples: 1`) has its points known before it runs: a
sweep with random values trains every trial.
"""

from __future__ import annotations

import itertools
import json
import time

from mlflow.entities import Metric, Param

from gpuflow.cluster.protocol import REUSED_RUN_TAG, WORK_KEY_TAG
from gpuflow.cluster.rerun.work_key import Undigestible, digest, finished_run_with_key, train_inputs, work_inputs
from gpuflow.cluster.spec import ExperimentSpec, trial_train

PLAN_ARTIFACT = "sweep/trials.json"


def grid_points(spec: ExperimentSpec) -> list[dict] | None:
    """Every point of a grid drawn once, in Tune's order; None for a sweep with random values."""
    sweep = spec.sweep
    if sweep is None or sweep.num_samples != 1 or any(p.kind != "grid" for p in sweep.parameters.values()):
        return None
    paths = list(sweep.parameters)
    return [
        dict(zip(paths, values, strict=True))
        for values in itertools.product(*(p.grid for p in sweep.parameters.values()))
    ]


def trial_as_run(spec: ExperimentSpec, values: dict) -> ExperimentSpec:
    """The trial at `values` as a run of its own: what its key digests."""
    compute = spec.compute.model_copy(update={"num_workers": spec.workers_per_trial, "min_workers": None})
    return spec.model_copy(update={"train": trial_train(spec.train, values), "sweep": None, "compute": compute})


def trial_plan(spec: ExperimentSpec, source: dict[str, str], diff: bytes, finds, reuse: bool) -> list[dict] | None:
    """Each grid point with its trial key and, when `reuse`, the FINISHED run that trained it (`finds(key)`: the
    experiment's newest with that key, or None). None when the points or their keys cannot be known."""
    points = grid_points(spec)
    if not points:
        return None
    try:
        inputs = work_inputs(trial_as_run(spec, {}), source, diff)  # the code and data, digested once
    except Undigestible:
        return None
    plan = []
    for values in points:
        key = digest({**inputs, **train_inputs(trial_train(spec.train, values))})
        found = finds(key) if reuse else None
        plan.append({"values": values, "key": key, "reused": found.info.run_id if found else None})
    return plan


def finder(client, experiment_id: str):
    return lambda key: finished_run_with_key(client, experiment_id, key)


# -- in the job ------------------------------------------------------------------------------------------------------
def read_plan(client, parent_run_id: str) -> list[dict] | None:
    """The plan the flow wrote on the parent run; None where it wrote none (every trial trains)."""
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as folder:
            return json.loads(open(client.download_artifacts(parent_run_id, PLAN_ARTIFACT, folder)).read())
    except Exception:
        return None


def reuse_trials(client, parent_id: str | None, plan: list[dict], inherited_tags: tuple[str, ...]) -> list[tuple]:
    """Records each point of the plan that an earlier run trained as a child run of the sweep (`record_reused`);
    returns (the point, that earlier run) for each."""
    points = [point for point in plan if point["reused"]]
    if not points or not parent_id:
        return []
    parent = client.get_run(parent_id)
    inherited = {key: parent.data.tags[key] for key in inherited_tags if key in parent.data.tags}
    return [(point, record_reused(client, parent, point, inherited)) for point in points]


def record_reused(client, parent, point: dict, inherited: dict[str, str]):
    """A child run of the sweep for a point an earlier run trained: its values, that run's final metrics, a link to
    it, no cost; `inherited`: the parent's tags every child carries. Returns the earlier run."""
    original = client.get_run(point["reused"])
    name = "reused " + " ".join(f"{path.rsplit('.', 1)[-1]}={value}" for path, value in point["values"].items())
    tags = {
        **inherited,
        "mlflow.parentRunId": parent.info.run_id,
        "mlflow.runName": name,
        REUSED_RUN_TAG: original.info.run_id,
        WORK_KEY_TAG: point["key"],
    }
    run = client.create_run(parent.info.experiment_id, run_name=name, tags=tags)
    now = int(time.time() * 1000)
    final = {**original.data.metrics, "trial_seconds": 0.0, "cost_usd": 0.0}  # its metrics; nothing billed here
    client.log_batch(
        run.info.run_id,
        metrics=[Metric(key, value, now, 0) for key, value in final.items()],
        params=[Param(path, str(value)) for path, value in point["values"].items()],
    )
    client.set_terminated(run.info.run_id, "FINISHED")
    print(f"[gpuflow] trial {name}: reused run {original.info.run_id}, trained nothing", flush=True)
    return original
