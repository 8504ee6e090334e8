"""What a spot interruption costs a run, with and without a notice and a proactive relaunch (issue #40).

    python benchmarks/spot_interruption.py [--epochs 2] [--step-pace 2] [--lead 30]

The same 2-node local run (digits at a step every --step-pace seconds, tests/loops/stepped.py), its worker node's
raylet SIGKILLed at the same step, each side in a fresh GPUFLOW_HOME through the real flow (Ray, MLflow, Prefect's
ephemeral API):

  (a) no notice: the loss comes unannounced; the run resumes from its last epoch checkpoint (before #40).
  (b) notice: the cloud's notice --lead seconds before the loss (a double of its metadata service); the loop
      checkpoints at every step until the node goes; the flow relaunches after the loss.
  (c) notice + proactive relaunch: as (b), and the flow provisions the replacement cluster on the notice.
  (d) elastic: no notice, compute.num_workers [1, 2]: no relaunch, Ray Train restarts the workers from the last
      epoch checkpoint on the head node and trains on with 1 worker.
  (e) notice + elastic: as (d), from the checkpoints taken on the notice.

The notice comes at the first step of the last epoch (--notice-step overrides); (b) runs first, and the sides
without a notice lose the node at the step (b) lost it at (those with one at their own deadline, so their step may
differ by one). Per side:

  - lost_compute_seconds: the run's own MLflow metric, defined in cluster/run/losses.py (worker-seconds paid for
    that did not move training on: training redone since the checkpoint resumed from, the recovery, a replacement
    idle beside the cluster still training), timed by the flow.
  - steps_redone: steps the lost cluster finished after the checkpoint the run resumed from: trained twice.
  - recovery_s: the loss (the SIGKILL) → the first step done after the resume.
  - printed beside, measured from outside: redone_s (the loss − when the checkpoint resumed from was written),
    replacement_before_loss_s, and the run's redone_seconds, the flow's view of redone_s.

Appends one row to benchmarks/README.md (`## spot_interruption`), the sides side by side.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

WORKERS = 2
FIGURES = ("lost_compute_seconds", "recovery_s", "steps_redone")


@dataclass(frozen=True)
class Side:
    key: str
    notice: bool  # the cloud's notice comes --lead seconds before the loss
    proactive: bool  # the flow provisions the replacement on the notice (capacity/replacement.py: relaunches_on_notice)
    overrides: list[str] = field(default_factory=list)  # spec overrides of this side


SIDES = [
    Side("b notice", notice=True, proactive=False),
    Side("a no notice", notice=False, proactive=False),
    Side("c proactive", notice=True, proactive=True),
    Side("d elastic", notice=False, proactive=False, overrides=["compute.num_workers=[1,2]"]),
    Side("e notice+elastic", notice=True, proactive=False, overrides=["compute.num_workers=[1,2]"]),
]


class Lines(logging.Handler):
    """Every Prefect log line of the run (the job's lines come through the train task's logger)."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def one_side(side: Side, args, kill_at_step: int | None) -> dict:
    home = Path(tempfile.mkdtemp(prefix="gpuflow-bench-"))
    os.environ["GPUFLOW_HOME"] = str(home)
    from mlflow import MlflowClient

    import gpuflow.flows.capacity.replacement as capacity
    from gpuflow.cluster.spec import load_spec
    from gpuflow.flows.experiment import run_experiment
    from tests.loops import STEPPED_LOOP
    from tests.support.interruption import Interruption
    from tests.support.metadata_double import metadata_double

    step_log = home / "steps.log"
    spec = load_spec(
        REPO / "experiments" / "digits.yaml",
        [
            f"workdir={REPO}",
            f"train.epochs={args.epochs}",
            "tracking.register_model=false",
            f"data.train={home}/data/train.parquet",
            f"data.validation={home}/data/validation.parquet",
            "compute.num_nodes=2",
            "compute.workers_per_node=1",
            f"compute.num_workers={WORKERS}",
            f"train.loop={STEPPED_LOOP}",
            f"train.params.step_pace_s={args.step_pace:g}",
            f"train.params.step_log={step_log}",
            *side.overrides,
        ],
    )
    proactive = capacity.relaunches_on_notice
    if not side.proactive:
        capacity.relaunches_on_notice = lambda spec, recovery: False
    lines = Lines()
    logging.getLogger("prefect").addHandler(lines)
    # every side has the double (Ray Train's watch of drains on, a notice asked for at each step): only (b) and
    # (c) get a notice from it
    with metadata_double("aws") as double:
        os.environ["GPUFLOW_METADATA_URL"] = double.url
        killer = Interruption(
            home, step_log, kill_at_step or args.notice_step, double if side.notice else None, lead_s=args.lead
        )
        killer.start()
        try:
            summary = run_experiment(spec)
        finally:
            capacity.relaunches_on_notice = proactive
            logging.getLogger("prefect").removeHandler(lines)
            del os.environ["GPUFLOW_METADATA_URL"]
    killer.join(timeout=5)
    assert killer.killed_at, f"{side.key}: the node was never killed"
    figures = killer.measured("\n".join(lines.messages))
    metrics = MlflowClient(tracking_uri=spec.tracking_uri).get_run(summary["run_id"]).data.metrics
    figures.update({key: metrics.get(key) for key in ("lost_compute_seconds", "redone_seconds")})
    shutil.rmtree(home, ignore_errors=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-pace", type=float, default=2.0, help="seconds a step takes at least")
    parser.add_argument("--lead", type=float, default=30.0, help="seconds from the notice to the loss")
    parser.add_argument(
        "--notice-step",
        type=int,
        default=None,
        help="steps done when the notice comes (default: the last epoch's first step)",
    )
    args = parser.parse_args()
    args.notice_step = args.notice_step or (args.epochs - 1) * 23 + 1  # digits on 2 workers: 23 steps an epoch
    results: dict[str, dict] = {}
    kill_at_step = None
    for side in SIDES:
        try:
            results[side.key] = one_side(side, args, kill_at_step if not side.notice else None)
        except Exception as exc:  # one side that fails leaves the others' figures ("—" for its own)
            print(f"[bench] {side.key} failed: {type(exc).__name__}: {exc}", flush=True)
            results[side.key] = {"killed_step": "—", **dict.fromkeys(FIGURES)}
        if isinstance(results[side.key]["killed_step"], int):
            kill_at_step = kill_at_step or results[side.key]["killed_step"]
        print(
            f"[bench] {side.key}: "
            + "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in results[side.key].items()),
            flush=True,
        )
    from benchmarks.record import record

    row = {
        "epochs": args.epochs,
        "step s": args.step_pace,
        "lead s": args.lead,
        "killed at step": "/".join(str(results[side.key]["killed_step"]) for side in SIDES),
    }
    for figure in FIGURES:
        for side in sorted(SIDES, key=lambda side: side.key):
            value = results[side.key][figure]
            row[f"{side.key.split()[0]} {figure}"] = "—" if value is None else float(value)
    record("spot_interruption", row)


if __name__ == "__main__":
    main()
