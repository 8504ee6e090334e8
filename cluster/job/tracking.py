"""Every `ray.train.report` of any loop, logged to the flow's MLflow run by Ray Train's controller.

    TorchTrainer(loop, run_config=RunConfig(callbacks=tracking_callbacks(run_id, tracking_uri)))

The callbacks run in Ray Train's controller, not in the workers: a loop needs no gpuflow code to be tracked. Ray
Train calls `after_report` once all workers have reported and after the report's checkpoint is persisted to storage,
so a step's metrics are logged only once its checkpoint exists. A background thread logs what is reported within a
few seconds in one call (MLflow's per-call latency would hold up the workers' next report; behind basic auth each call
costs a password check); a resumed attempt skips steps the run holds. An elastic run also logs `workers` per report.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from typing import Any

from ray.train.v2.api.callback import UserCallback

from gpuflow.cluster.job.reports import (
    MAX_METRICS_PER_CALL,
    Report,
    numbers_of,
    persisted_reports,
    report_time_ms,
    step_of,
    uri_of,
)
from gpuflow.cluster.protocol import CHECKPOINT_TAG, TRAINED_TAG, checkpoint_line, epoch_line
from gpuflow.cluster.util.ray_internals import SNAPSHOT_FILE, ControllerCallback  # end of run: no public hook yet

FINISH_TIMEOUT_S = 120
BATCH_WINDOW_S = 3.0  # reports within this long of the first queued go to MLflow together: one call, not one each


class MlflowTracker:
    """Owns the MLflow client and the background thread; the two callbacks below share one tracker."""

    def __init__(self, run_id: str, tracking_uri: str, print_progress: bool = True, snapshot_uri: str | None = None):
        self.run_id, self.tracking_uri, self.print_progress = run_id, tracking_uri, print_progress
        self.snapshot_uri = snapshot_uri  # Ray Train's record of the persisted checkpoints and their reports
        self.reports_seen = 0
        self.checkpoints: list[dict] = []
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._logged_before: dict[str, int] = {}  # key -> max step the run held when this attempt first saw it
        self._logged: dict[str, int] = {}  # key -> max step logged so far
        self._client = None
        self._keys_in_run, self._run_info = None, None  # metric keys, experiment, artifact URI: one read (_read_run)
        self._pending: list[tuple[list, list]] = []  # batches MLflow has not taken yet (the server was down)
        self._unreachable = False
        self._persisted_queued = False  # a lost attempt's persisted reports: queued once (_start)

    def __getstate__(self):  # pickled into Ray Train's controller: threads and clients are made there
        return {**self.__dict__, "_queue": None, "_thread": None, "_client": None}

    @property
    def client(self):
        if self._client is None:
            from mlflow import MlflowClient  # here, off the controller's start (it unpickles this module): seconds

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    # -- on the controller's thread: cheap, never waits for MLflow ---------------------------------------
    def add(self, metrics: dict[str, Any], checkpoint) -> Report:
        step_key, step = step_of(metrics)
        values = numbers_of({k: v for k, v in metrics.items() if k != step_key})
        uri = uri_of(checkpoint) if checkpoint else None
        report = Report(self.reports_seen, step, values, uri, report_time_ms(uri))  # a backfill's time too
        self.reports_seen += 1
        self._start()
        self._queue.put(report)
        if self.print_progress:
            shown = " ".join(f"{k}={v:.4g}" for k, v in values.items())
            line = (
                epoch_line(step, shown)
                if step_key == "epoch"
                else f"[gpuflow] report {report.index}" + (f" (step {step})" if step is not None else "") + f": {shown}"
            )
            print(
                *([checkpoint_line(report.index if step is None else step)] if checkpoint else []),
                line,
                sep="\n",
                flush=True,
            )
        return report

    def _start(self) -> None:
        """The queue and its thread; queued first (once), what a lost attempt persisted and may not have logged."""
        if self._thread is None:
            self._queue = queue.Queue()
            if not self._persisted_queued:
                for earlier in persisted_reports(self.snapshot_uri):
                    self._queue.put(earlier)
                self._persisted_queued = True
            self._thread = threading.Thread(target=self._drain, name="gpuflow-mlflow", daemon=True)
            self._thread.start()

    def finish(self, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        """Logs everything still queued (an attempt resumed with nothing left to train: the lost one's reports);
        returns when it is in MLflow (or the timeout passed)."""
        if not self._persisted_queued:
            self._start()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            self._thread = None

    # -- on the background thread -------------------------------------------------------------------------
    def _drain(self) -> None:
        done = False
        while not done:
            batch, until = [self._queue.get()], time.monotonic() + BATCH_WINDOW_S
            while batch[-1] is not None:  # what queues up within the window goes in the same batch (call)
                try:
                    batch.append(self._queue.get(timeout=max(0.0, until - time.monotonic())))
                except queue.Empty:
                    break
            done = None in batch
            reports = [report for report in batch if report is not None]
            if reports:
                self._log(reports)
        self._deliver(deadline=time.monotonic() + FINISH_TIMEOUT_S)

    def _first_seen(self, key: str) -> int:
        """The highest step the run held for this key before this attempt (-1: none): a resume skips those."""
        if key not in self._logged_before:
            try:
                if self._keys_in_run is None:  # one read: only a resumed run's keys need their history
                    self._read_run()
                history = self.client.get_metric_history(self.run_id, key) if key in self._keys_in_run else []
            except Exception:
                history = []
            self._logged_before[key] = max((m.step for m in history), default=-1)
            self._logged[key] = self._logged_before[key]
        return self._logged_before[key]

    def _log(self, reports: list[Report]) -> None:
        from mlflow.entities import Metric, RunTag

        metrics, tags = [], []
        for report in reports:
            for key, value in report.metrics.items():
                before = self._first_seen(key)
                # no step of its own: count on after what an earlier attempt logged
                step = report.step if report.step is not None else before + 1 + report.index
                if step <= self._logged[key]:
                    continue  # a resumed attempt repeating a step the run already holds
                self._logged[key] = step
                metrics.append(Metric(key, value, report.at_ms, step))
            if report.checkpoint_uri:
                step = report.step if report.step is not None else report.index
                self.checkpoints.append({"step": step, "uri": report.checkpoint_uri})
                tags = [RunTag(CHECKPOINT_TAG, report.checkpoint_uri), RunTag(CHECKPOINT_TAG + "_step", str(step))]
        self._pending.append((metrics, tags))
        self._deliver()

    def _deliver(self, deadline: float | None = None) -> bool:
        """Logs what is pending, oldest first. A tracking server that is down keeps it pending (training goes on),
        delivered with the next report once the server is back, or at the end (until `deadline`)."""
        while self._pending:
            metrics, tags = self._pending[0]
            try:
                for start in range(0, max(len(metrics), 1), MAX_METRICS_PER_CALL):
                    self.client.log_batch(
                        self.run_id,
                        metrics=metrics[start : start + MAX_METRICS_PER_CALL],
                        tags=tags if start == 0 else [],
                        synchronous=True,
                    )
            except Exception as exc:
                if not self._unreachable:
                    print(
                        f"[gpuflow] warning: MLflow unreachable ({type(exc).__name__}); metrics are kept and "
                        "logged once it is back",
                        flush=True,
                    )
                self._unreachable = True
                if deadline is None or time.monotonic() > deadline:
                    return False
                time.sleep(2)
                continue
            self._pending.pop(0)
            if self._unreachable:
                print("[gpuflow] MLflow is back: the metrics kept meanwhile are logged", flush=True)
                self._unreachable = False
        return True

    def _call(self, log) -> None:
        for attempt in range(3):  # a blip of the tracking server must not stop the run's end
            try:
                return log()
            except Exception as exc:
                if attempt == 2:
                    print(
                        f"[gpuflow] warning: MLflow logging failed, some values are not in the run: {exc}", flush=True
                    )
                else:
                    time.sleep(1 + attempt * 4)

    def _read_run(self):  # once: the metric keys the run already holds, its experiment and its artifact URI
        if self._run_info is None:
            run = self.client.get_run(self.run_id)
            self._keys_in_run, self._run_info = set(run.data.metrics), run.info
        return self._run_info

    # -- at the end of the run ------------------------------------------------------------------------------
    def close_run_records(self, checkpoint, succeeded: bool) -> None:
        """That the training ended well; the list of checkpoints as an artifact; and a run that logged no model gets
        its last checkpoint."""
        from gpuflow.cluster.run.mlflow_run import artifact_repo, log_text_to

        self.finish()
        if succeeded:  # said first: a flow that dies from here on leaves a run that trained, FINISHED (true_status)
            self._call(
                lambda: self.client.set_tag(
                    self.run_id, TRAINED_TAG, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                )
            )
        artifacts = lambda: artifact_repo(self._read_run().artifact_uri, self.tracking_uri)  # noqa: E731
        if self.checkpoints:
            self._call(lambda: log_text_to(artifacts(), json.dumps(self.checkpoints, indent=1), "checkpoints.json"))
        if succeeded and checkpoint is not None and not self.logged_a_model():

            def upload():
                with checkpoint.as_directory() as folder:
                    artifacts().log_artifacts(folder, "checkpoint")

            self._call(upload)
            print("[gpuflow] no model logged: the run's artifact 'checkpoint' is its last checkpoint", flush=True)

    def logged_a_model(self) -> bool:
        try:
            experiment = self._read_run().experiment_id
            return bool(
                self.client.search_logged_models([experiment], filter_string=f"source_run_id = '{self.run_id}'")
            )
        except Exception:
            return False


class ReportToMlflow(UserCallback):
    """Ray Train's public hook: each round of reports (one per worker), checkpoint already persisted."""

    def __init__(self, tracker: MlflowTracker, count_workers: bool = False):
        self.tracker, self.count_workers = tracker, count_workers

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        self.tracker.add(
            {
                **(metrics[0] if metrics else {}),  # rank 0's metrics, and how many workers reported
                **({"workers": len(metrics)} if self.count_workers else {}),
            },
            checkpoint,
        )


class FinishTracking(ControllerCallback):
    """Flushes what is queued before the controller exits, whatever the outcome."""

    def __init__(self, tracker: MlflowTracker):
        self.tracker = tracker

    def after_controller_finish(self, result) -> None:
        self.tracker.close_run_records(result.checkpoint, succeeded=result.error is None)

    def before_controller_abort(self) -> None:
        self.tracker.finish(timeout_s=10)


def tracking_callbacks(
    run_id: str | None, tracking_uri: str | None, run_folder: str | None = None, count_workers: bool = False
) -> list:
    """Ray Train's callbacks into the run (none without one); `run_folder`: where Ray Train keeps its snapshot."""
    if not run_id or not tracking_uri:
        return []
    snapshot = f"{run_folder.rstrip('/')}/{SNAPSHOT_FILE}" if run_folder else None
    tracker = MlflowTracker(run_id, tracking_uri, snapshot_uri=snapshot)  # pickled once with both: state is shared
    return [ReportToMlflow(tracker, count_workers), FinishTracking(tracker)]
