"""The chaos soak's invariants, read from the five records of every run after the reconciler's pass: the Prefect flow
run, the MLflow run, the cluster (and every process under the soak's GPUFLOW_HOME), the quota's slots, the messages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

INVARIANTS = (
    "flow runs final",
    "no MLflow run RUNNING",
    "no cluster left",
    "no quota slot held",
    "one message per bad end",
)  # a bad end: Failed or Crashed; Completed and Cancelled get none


@dataclass
class Check:
    figures: dict
    violations: list[str] = field(default_factory=list)  # "invariant: which record broke it"
    records: dict = field(default_factory=dict)  # flow run id -> its records, for the report
    states: dict = field(default_factory=dict)  # flow run id -> its state's type ("COMPLETED", ...), None: no state


def check(stack) -> Check:
    from mlflow import MlflowClient

    from gpuflow.cluster.backends.local import LocalBackend
    from gpuflow.cluster.protocol import NOTIFIED_TAG, STOPPED_BY_TAG
    from gpuflow.flows.quota.pools import LIMIT_PREFIX
    from tests.support.tiers import carrying, describe

    violations, records = [], {}
    with stack.client() as client:
        flow_runs = runs_of_experiments(client)
        limits = [
            limit for limit in client.read_global_concurrency_limits(limit=200) if limit.name.startswith(LIMIT_PREFIX)
        ]
    mlflow = MlflowClient(stack.mlflow_url)
    experiments = [e.experiment_id for e in mlflow.search_experiments()]
    mlflow_runs = mlflow.search_runs(experiments, max_results=1000) if experiments else []
    by_flow_run = {}
    for mlflow_run in mlflow_runs:
        by_flow_run.setdefault(mlflow_run.data.tags.get("prefect.flow_run_id", "?"), []).append(mlflow_run)

    bad_ends, messages_per_bad = 0, []
    for run in flow_runs:
        flow_run_id, state = str(run.id), run.state
        events = [e for e in stack.webhook.messages.get(flow_run_id, []) if e != "recovered"]
        mine = by_flow_run.get(flow_run_id, [])
        records[flow_run_id] = {
            "flow run": f"{run.name} {state.name if state else 'no state'}: {((state and state.message) or '')[:160]}",
            "tags": ",".join(tag for tag in run.tags if tag.startswith("quota")),
            "mlflow": [
                f"{r.info.run_id} {r.info.status} stopped_by={r.data.tags.get(STOPPED_BY_TAG, '-')} "
                f"notified={r.data.tags.get(NOTIFIED_TAG, '-')}"
                for r in mine
            ],
            "messages": events,
        }
        if not (state and state.is_final()):
            violations.append(f"flow runs final: {flow_run_id} is {state.name if state else 'without a state'}")
        elif state.is_cancelled():  # a person's own stop: not messaged, by design (flows/run_messages.py notify_end)
            if events:
                violations.append(f"one message per bad end: {flow_run_id} Cancelled yet messaged {events}")
        elif not state.is_completed():
            bad_ends += 1
            messages_per_bad.append(len(events))
            if len(events) != 1:
                violations.append(
                    f"one message per bad end: {flow_run_id} ended {state.name} with {len(events)} message(s) {events}"
                )
        elif events:
            violations.append(f"one message per bad end: {flow_run_id} Completed yet messaged {events}")
    running = [r for r in mlflow_runs if r.info.status == "RUNNING"]
    for r in running:
        violations.append(
            f"no MLflow run RUNNING: {r.info.run_id} of flow run {r.data.tags.get('prefect.flow_run_id', '?')}"
        )
    clusters = LocalBackend(root=stack.home / "clusters").status()
    for cluster in clusters:
        violations.append(f"no cluster left: {cluster.name} ({cluster.status})")
    processes = carrying("GPUFLOW_HOME", str(stack.home), {os.getpid()})
    for process in processes:
        violations.append(f"no cluster left: process {describe(process)}")
    held = sum(limit.active_slots for limit in limits)
    for limit in limits:
        if limit.active_slots:
            violations.append(f"no quota slot held: {limit.name} holds {limit.active_slots} of {limit.limit}")
    final = sum(bool(r.state and r.state.is_final()) for r in flow_runs)
    return Check(
        {
            "flow runs final": f"{final}/{len(flow_runs)}",
            "MLflow RUNNING": len(running),
            "clusters left": len(clusters),
            "processes left": len(processes),
            "slots held": held,
            "messages per bad end": ",".join(map(str, sorted(messages_per_bad))) or "no bad end",
            "bad ends": bad_ends,
        },
        violations,
        records,
        {str(run.id): run.state and run.state.type.value for run in flow_runs},
    )


RESTART_S = 15  # a killed server's start-up after its time down, on a loaded machine
WHOLE = {"none", "webhook-down", "mlflow-restart"}  # faults a run trains through: it must end Completed


def check_plan(plan, found: Check) -> None:
    """What the soak planned against what it finds: every fault applied (a run that ended before its fault could
    strike proves nothing), every run's flow run seen, a run its fault leaves whole Completed, and a run whose
    teardown failed Failed saying so (its cluster and slot are the invariants' of every run). Adds violations."""
    from benchmarks.chaos_faults import NOT_YET

    for run in plan:
        unapplied = not run.applied or run.applied.startswith((NOT_YET, "could not apply"))
        ended = found.records.get(run.flow_run_id or "", {}).get("flow run", "no flow run")
        # A run going as Prefect's API restarts ends where the API went; `gpuflow run` refuses at once a server that
        # does not answer, so a run begun while another run's fault had one down ends there, with no flow run. Its
        # own fault then has nothing left to strike, nor its end to show: the invariants of its records still hold it
        excused = struck_by_another(run, plan) or (
            run.flow_run_id is None and struck_by_another(run, plan, ("prefect", "mlflow"))
        )
        if unapplied and not excused:
            found.violations.append(f"every fault applied: run {run.index}'s {run.fault['name']}: {run.applied}")
        if run.hung:
            found.violations.append(f"no run hung: run {run.index} was still going after the bound")
        if run.flow_run_id and run.flow_run_id not in found.records:
            found.violations.append(
                f"every run seen: run {run.index}'s flow run {run.flow_run_id} is not on its server"
            )
        if run.fault["name"] in WHOLE and not excused and found.states.get(run.flow_run_id) != "COMPLETED":
            found.violations.append(f"a whole run completes: run {run.index} ({run.fault['name']}) ended {ended}")
        # a teardown that came after the fault lifted proves nothing
        if run.fault["target"] == "teardown" and run.struck_s is not None and not excused:
            if "could not tear down" not in ended:
                found.violations.append(f"a failed teardown is said: run {run.index} ended {ended}")
    found.figures["flow runs seen/planned"] = f"{len(found.records)}/{len(plan)}"


def struck_by_another(run, plan, servers=("prefect",)) -> bool:
    """Whether another run's fault on a shared server (a restart of one of `servers`) struck while this run was
    going (from its start to its end, the server's time down included)."""
    for other in plan:
        if other is not run and other.fault["target"] in servers and other.struck_s is not None:
            down_from = other.started + other.struck_s
            down_to = down_from + other.fault["down_s"] + RESTART_S
            if down_from <= (run.ended or float("inf")) and run.started <= down_to:
                return True
    return False


def runs_of_experiments(client) -> list:
    """Every flow run but the reaper's passes (hundreds of them beside a long soak)."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterId

    from gpuflow.flows.quota.pools import every_flow_run

    others = [flow.id for flow in client.read_flows() if flow.name != "reap-clusters"]
    return every_flow_run(client, flow_filter=FlowFilter(id=FlowFilterId(any_=others))) if others else []
