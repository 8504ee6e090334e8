"""The flow⇄job contract (cluster/protocol.py), both ways: what one side writes, the other reads back."""

from gpuflow.cluster.protocol import SETUP_DONE, JobEnv, epoch_line, parse_line, result_line, stop_line, trial_line


def test_the_job_env_reads_back_what_the_flow_wrote():
    sent = JobEnv(
        tracking_uri="sqlite:////tmp/x/mlflow.db",
        mlflow_run_id="abc123",
        requested_at=1764000000.125,
        hourly_usd=2.5,
        local_cluster_session=4242,
        spec_json='{"name": "x"}',
        run_name="x-1a2b",
    )
    env = sent.to_env()
    assert env["GPUFLOW_MLFLOW_RUN_ID"] == "abc123" and env["MLFLOW_TRACKING_URI"] == sent.tracking_uri
    assert JobEnv.from_env(env) == sent


def test_unset_fields_stay_out_of_the_environment():
    env = JobEnv(mlflow_run_id="abc").to_env()
    assert env == {"GPUFLOW_MLFLOW_RUN_ID": "abc"}
    assert JobEnv.from_env(env) == JobEnv(mlflow_run_id="abc")
    assert JobEnv.from_env({}) == JobEnv()


def test_each_line_the_job_writes_is_read_as_its_event():
    summary = {"metrics": {"val_accuracy": 0.97}, "checkpoint": "/c/checkpoint_9", "storage": "/c"}
    assert parse_line(result_line(summary)).value == summary
    assert parse_line("(task, pid=1234) " + result_line(summary)).value == summary  # SkyPilot's prefix
    assert parse_line(stop_line("timeout", "ran 15 min")).value == ("timeout", "ran 15 min")
    assert parse_line(epoch_line(7, "train_loss=0.1 val_accuracy=0.9")).value == 7
    assert parse_line(trial_line("t_00003", "terminated after 4.0s", 3, 6)).value == (3, 6)
    assert parse_line(f"{SETUP_DONE}: starting Ray on 2 node(s)").kind == "setup_done"


def test_other_lines_are_no_event():
    summary = result_line({"metrics": {}, "checkpoint": None, "storage": "/c"})
    assert parse_line("(RayTrainWorker pid=77) " + summary) is None  # a worker echoing it is not the job's result
    assert parse_line("epoch 3: loss=0.1") is None and parse_line("[gpuflow] 1/2 Ray nodes joined") is None
