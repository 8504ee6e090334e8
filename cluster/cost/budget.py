"""The daily budget under concurrency: a run writes a reservation of the most it may cost, then reads the day's total.

    GPUFLOW_DAILY_BUDGET_USD=50 gpuflow run my.yaml     # two runs at once never both pass a budget that fits one

Write-then-read: each run counts every reservation written before it reads, its rivals' included, so of
two runs that fit the budget only together, at least one sees both and is refused. The ledger is the
tracking store, which every worker of a team already shares. A reservation is released (replaced by the
run's real cost, logged to its MLflow run) at the end of the run; if the flow died, it lapses after the
run's maximum runtime plus a margin, and the run's own MLflow record is counted from then on.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from mlflow import MlflowClient

from gpuflow.cluster.config import DAILY_BUDGET_ENV, daily_budget
from gpuflow.cluster.cost.predict import Prediction
from gpuflow.cluster.cost.pricing import Estimate, hourly_cost
from gpuflow.cluster.cost.spend import run_costs, start_of_today_utc
from gpuflow.cluster.protocol import RESERVATION_EXPIRES_TAG, RESERVED_FOR_TAG
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.util.local_store import ready_local_store

RESERVATIONS_EXPERIMENT = "gpuflow-budget-reservations"
RESERVED_METRIC = "reserved_usd"
LAPSE_MARGIN_S = 1800  # provisioning and teardown come on top of max_runtime_minutes
ATTEMPTS = 4  # refused only because of rivals' reservations: release, wait a little, try again


class BudgetExceeded(ValueError):
    """The run could cost more than a limit allows; the message gives both figures and what to change."""


def check_run_budget(spec: ExperimentSpec, estimate: Estimate, prediction: Prediction | None = None) -> None:
    """Refuses a run whose hourly price × limits.max_runtime_minutes exceeds limits.max_cost_usd; the refusal says
    the prediction from past runs too, when there is one."""
    limit = spec.limits.max_cost_usd
    worst = estimate.max_runtime_cost_usd(spec)
    if limit is None or worst <= limit:
        return
    affordable_minutes = limit / estimate.hourly_usd * 60
    raise BudgetExceeded(
        f"limits.max_cost_usd: this run may cost ${worst:.2f} (${estimate.hourly_usd:.4g}/h × "
        f"{spec.limits.max_runtime_minutes:g} min of limits.max_runtime_minutes), more than max_cost_usd=${limit:.2f}. "
        f"Lower limits.max_runtime_minutes to {affordable_minutes:.0f} or less, raise limits.max_cost_usd to "
        f"{worst:.2f}, or pick cheaper compute ({estimate.describe()})"
        f"{prediction.refusal_note(estimate, limit, 'max_cost_usd') if prediction else ''}"
    )


def daily_budget_usd() -> float | None:
    value = daily_budget()
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise BudgetExceeded(f"{DAILY_BUDGET_ENV}={value!r} is not a number of dollars; write e.g. 50") from None


def check_daily_budget(
    spec: ExperimentSpec,
    estimate: Estimate,
    spent_today_usd: float,
    budget_usd: float | None,
    prediction: Prediction | None = None,
) -> None:
    """Refuses a run that could take today's spend (runs started since 00:00 UTC) past the daily budget."""
    if budget_usd is None:
        return
    worst = estimate.max_runtime_cost_usd(spec)
    if spent_today_usd + worst <= budget_usd:
        return
    raise BudgetExceeded(
        f"{DAILY_BUDGET_ENV}=${budget_usd:.2f}: runs started today (UTC) cost ${spent_today_usd:.2f} and this one "
        f"may cost ${worst:.2f}, ${spent_today_usd + worst:.2f} in all. Lower limits.max_runtime_minutes, "
        f"raise {DAILY_BUDGET_ENV}, or wait until 00:00 UTC"
        f"{prediction.refusal_note(estimate, budget_usd - spent_today_usd, 'budget left') if prediction else ''}"
    )


@dataclass(frozen=True)
class Reservation:
    tracking_uri: str
    run_id: str
    owner: str
    amount_usd: float


def reserve(tracking_uri: str, owner: str, amount_usd: float, hold_s: float) -> Reservation:
    """Writes a reservation of `amount_usd` for `owner`, valid for `hold_s` seconds."""
    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.create_run(
        reservations_experiment(client),
        run_name=f"reserved-{owner}",
        tags={RESERVED_FOR_TAG: owner, RESERVATION_EXPIRES_TAG: f"{time.time() + hold_s:.0f}"},
    )
    client.log_metric(run.info.run_id, RESERVED_METRIC, amount_usd, synchronous=True)
    return Reservation(tracking_uri, run.info.run_id, owner, amount_usd)


def reservations_experiment(client: MlflowClient) -> str:
    experiment = client.get_experiment_by_name(RESERVATIONS_EXPERIMENT)
    if experiment:
        return experiment.experiment_id
    try:
        return client.create_experiment(RESERVATIONS_EXPERIMENT)
    except Exception:  # created at the same moment by another run
        return client.get_experiment_by_name(RESERVATIONS_EXPERIMENT).experiment_id


def active_reservations(tracking_uri: str, since: float, now: float | None = None) -> list[Reservation]:
    """Reservations written since `since`, neither released nor lapsed."""
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(RESERVATIONS_EXPERIMENT)
    if not experiment:
        return []
    now = time.time() if now is None else now
    runs = client.search_runs(
        [experiment.experiment_id],
        max_results=10_000,
        filter_string=f"attributes.status = 'RUNNING' and attributes.start_time >= {int(since * 1000)}",
    )
    return [
        Reservation(
            tracking_uri,
            run.info.run_id,
            run.data.tags.get(RESERVED_FOR_TAG, ""),
            run.data.metrics.get(RESERVED_METRIC, 0.0),
        )
        for run in runs
        if float(run.data.tags.get(RESERVATION_EXPIRES_TAG, 0)) > now
    ]


def committed_since_usd(tracking_uri: str, since: float, exclude: Reservation | None = None) -> tuple[float, int]:
    """What today's runs cost or may still cost, and how many rivals' reservations that includes.

    A run with a live reservation counts as its reservation (its most), not as its cost so far."""
    reservations = [r for r in active_reservations(tracking_uri, since) if not exclude or r.run_id != exclude.run_id]
    reserved_owners = {r.owner for r in reservations} | ({exclude.owner} if exclude else set())
    spent = sum(row.cost_usd for row in run_costs(tracking_uri, since) if row.flow_run_id not in reserved_owners)
    return spent + sum(r.amount_usd for r in reservations), len(reservations)


def reserve_within_budget(
    spec: ExperimentSpec,
    estimate: Estimate,
    budget_usd: float,
    owner: str,
    attempts: int = ATTEMPTS,
    prediction: Prediction | None = None,
) -> Reservation | None:
    """Reserves the run's most (price × max runtime); refuses it (BudgetExceeded) if today's total breaks the budget.

    Returns the reservation to release at the run's end (None for a free run: nothing to reserve)."""
    worst = estimate.max_runtime_cost_usd(spec)
    since = start_of_today_utc()
    if worst <= 0:
        check_daily_budget(spec, estimate, committed_since_usd(spec.tracking_uri, since)[0], budget_usd, prediction)
        return None
    # the run may first wait for the team's GPU quota (limits.max_queue_minutes): the reservation outlasts that too
    hold_s = (spec.limits.max_queue_minutes + spec.limits.max_runtime_minutes) * 60 + LAPSE_MARGIN_S
    for attempt in range(attempts):
        reservation = reserve(spec.tracking_uri, owner, worst, hold_s)
        others, rivals = committed_since_usd(spec.tracking_uri, since, exclude=reservation)
        try:
            check_daily_budget(spec, estimate, others, budget_usd, prediction)
            return reservation
        except BudgetExceeded:
            release(reservation)
            if not rivals or attempt == attempts - 1:
                raise
        # Rivals may be refused too and release theirs: back off by a random amount so that one gets through.
        time.sleep(random.uniform(0.2, 1.5))
    raise AssertionError("unreachable")


def release(reservation: Reservation) -> None:
    MlflowClient(tracking_uri=reservation.tracking_uri).set_terminated(reservation.run_id, "FINISHED")


def release_reservations_of(tracking_uri: str, owner: str) -> int:
    """Releases every live reservation of a run (found by its flow run id, so any process can do it)."""
    released = 0
    for reservation in active_reservations(tracking_uri, since=0):
        if reservation.owner == owner:
            release(reservation)
            released += 1
    return released


# -- the run's side: checked before launch, settled at its end ---------------------------------------------------
def check_budget(
    spec: ExperimentSpec, flow_run_id: str | None = None, prediction: Prediction | None = None
) -> Estimate:
    """Prices the cluster and refuses the run if it could break limits.max_cost_usd or the daily budget.

    With a flow run id the run's most is reserved first (write, then read), so that runs started together
    cannot all pass a budget that fits one; the flow calls settle_budget(spec, flow_run_id) at its end.
    Without one (`gpuflow validate`), it only reads. The refusal is decided on the bound, never on the prediction
    (which a refusal only quotes): the bound is what the run's limits enforce, so a run let in on its prediction
    could still spend the bound, and reservations made on predictions would let concurrent runs past the budget."""
    estimate = hourly_cost(spec)
    check_run_budget(spec, estimate, prediction)
    budget = daily_budget_usd()
    if budget is not None:
        ready_local_store(spec.tracking_uri)  # read (and written) by runs that start together
        if flow_run_id:
            reserve_within_budget(spec, estimate, budget, str(flow_run_id), prediction=prediction)
        else:
            committed, _ = committed_since_usd(spec.tracking_uri, start_of_today_utc())
            check_daily_budget(spec, estimate, committed, budget, prediction)
    return estimate


def settle_budget(spec: ExperimentSpec, flow_run_id: str) -> None:
    """At the run's end: its budget reservation gives way to the real cost logged in its MLflow run (cost_usd)."""
    if daily_budget_usd() is not None:
        release_reservations_of(spec.tracking_uri, str(flow_run_id))
