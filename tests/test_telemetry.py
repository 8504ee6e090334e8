"""Training telemetry: the step timer and profiler on real torch loops, the peak table, the GPU benchmark on CPU,
and per-epoch figures plus a profiler trace in MLflow from real runs of the digits and char-GPT examples."""

import json
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from gpuflow.cluster.spec import SpecError, load_spec, parse_spec
from gpuflow.cluster.telemetry import ProfileWindow, StepTimer, model_flops_per_sample, peak_tflops
from tests.support.repo import A_LOOP, REPO

PERF_KEYS = (
    "perf/samples_per_s",
    "perf/step_time_ms",
    "perf/data_wait_pct",
    "perf/peak_memory_mb",
    "perf/epoch_s",
    "perf/worker_rss_mb",
)


class SlowData(torch.utils.data.Dataset):
    """Examples that take `delay_s` each to load, like a slow disk or decoder."""

    def __init__(self, count: int, delay_s: float):
        self.count, self.delay_s = count, delay_s

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        time.sleep(self.delay_s)
        return torch.randn(8), torch.tensor(index % 2)


def train_one_epoch(timer: StepTimer, loader, model, optimizer, compute_s: float = 0.0) -> int:
    steps = 0
    for inputs, labels in timer.steps(loader):
        time.sleep(compute_s)  # a model that takes compute_s per step
        loss = nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    return steps


@pytest.mark.parametrize(
    "name, precision, tf32, expected",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", False, 989),
        ("NVIDIA H100 80GB HBM3", "fp32", False, 67),
        ("NVIDIA H100 80GB HBM3", "fp32", True, 494),
        ("NVIDIA H100 PCIe", "bf16", False, 756),
        ("NVIDIA A100-SXM4-80GB", "bf16", False, 312),
        ("NVIDIA A10", "fp16", False, 125),
        ("NVIDIA L4", "bf16", False, 121),
        ("NVIDIA L40S", "bf16", False, 362),
        ("NVIDIA A10G", "bf16", False, None),  # not in the table: no MFU rather than a wrong one
        ("cpu", "fp32", False, None),
    ],
)
def test_peak_table_matches_whole_device_names(name, precision, tf32, expected):
    assert peak_tflops(name, precision, tf32) == expected


def test_timer_measures_throughput_steps_and_data_wait():
    """A loader that takes 40 ms a batch against steps of 10 ms: mostly waiting; a ready loader: hardly at all."""
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    slow = torch.utils.data.DataLoader(SlowData(40, delay_s=0.01), batch_size=4)
    ready = [(torch.randn(4, 8), torch.zeros(4, dtype=torch.long))] * 10
    timer = StepTimer("cpu", flops_per_sample=model_flops_per_sample(model), world_size=2)

    started = time.perf_counter()
    assert train_one_epoch(timer, slow, model, optimizer, compute_s=0.01) == 10
    elapsed = time.perf_counter() - started
    slow_figures = timer.end_epoch()
    train_one_epoch(timer, ready, model, optimizer, compute_s=0.01)
    ready_figures = timer.end_epoch()

    # 40 samples on this worker, ×2 workers, in at most the measured wall time
    assert slow_figures["perf/samples_per_s"] >= 2 * 40 / elapsed
    assert 1000 * elapsed / 10 >= slow_figures["perf/step_time_ms"] >= 40 + 10

    # the wait per step, in ms: sleeps only get longer on a busy machine, so these bounds hold under load
    def waited_ms(figures):
        return figures["perf/data_wait_pct"] / 100 * figures["perf/step_time_ms"]

    assert waited_ms(slow_figures) >= 40 > 10 > waited_ms(ready_figures)
    assert slow_figures["perf/data_wait_pct"] > ready_figures["perf/data_wait_pct"]
    assert ready_figures["perf/step_time_ms"] >= 10
    assert slow_figures["perf/peak_memory_mb"] > 10  # the process's peak RSS on CPU
    assert "perf/mfu_pct" not in slow_figures and "peak FLOPs of 'cpu' are unknown" in timer.mfu_note
    assert timer.end_epoch() == {}  # nothing ran since the last epoch


def test_mfu_is_model_flops_over_the_peak():
    model = nn.Linear(8, 2)  # 18 parameters: 108 FLOPs per sample
    timer = StepTimer("cpu", flops_per_sample=model_flops_per_sample(model), tokens_per_sample=3)
    timer.peak_flops = 1e6  # a made-up device of 1 MFLOPS
    train_one_epoch(
        timer,
        torch.utils.data.DataLoader(SlowData(16, 0.0), batch_size=4),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
    )
    figures = timer.end_epoch()
    assert figures["perf/mfu_pct"] == pytest.approx(100 * 108 * figures["perf/samples_per_s"] / 1e6)
    assert figures["perf/tokens_per_s"] == pytest.approx(3 * figures["perf/samples_per_s"])


def test_profile_window_writes_a_chrome_trace_and_operator_table(tmp_path):
    written = []
    model = nn.Linear(8, 2)
    window = ProfileWindow(torch.device("cpu"), steps=3, after=2, on_ready=written.append, folder=tmp_path)
    timer = StepTimer("cpu", profile=window)
    train_one_epoch(
        timer,
        torch.utils.data.DataLoader(SlowData(40, 0.0), batch_size=4),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
    )
    timer.close()  # the window closed after step 5 by itself: nothing more is written
    assert written == [tmp_path]
    assert window.recorded_steps == 3
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::addmm" in names and sum(name.startswith("ProfilerStep") for name in names if name) == 3
    table = (tmp_path / "top_operators.txt").read_text()
    assert "3 step(s) recorded after skipping 2" in table and "aten::" in table


def test_a_run_shorter_than_the_window_writes_what_it_recorded(tmp_path):
    written = []
    model = nn.Linear(8, 2)
    timer = StepTimer(
        "cpu", profile=ProfileWindow(torch.device("cpu"), steps=20, after=1, on_ready=written.append, folder=tmp_path)
    )
    train_one_epoch(
        timer,
        torch.utils.data.DataLoader(SlowData(16, 0.0), batch_size=4),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
    )
    assert written == []
    timer.close()
    assert written == [tmp_path] and timer.profile.recorded_steps == 3
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


def test_profile_field_is_checked_before_anything_runs():
    assert parse_spec(A_LOOP).profile is None
    assert parse_spec({**A_LOOP, "profile": {}}).profile.model_dump() == {"steps": 20, "after": 5}
    with pytest.raises(SpecError, match=r"profile\.steps: .*greater than or equal to 1 \(got 0\)"):
        parse_spec({**A_LOOP, "profile": {"steps": 0}})
    with pytest.raises(SpecError, match=r"profile\.every: unknown field"):
        parse_spec({**A_LOOP, "profile": {"every": 3}})


def test_gpu_benchmark_runs_on_cpu_with_plain_torch(tmp_path):
    """The benchmark imports no Ray, Prefect or MLflow (the GPU machine has only torch) and measures both loops."""
    out = tmp_path / "result.json"
    script = (
        "import runpy, sys; sys.argv = ['gpu_throughput.py', '--tiny', '--steps', '3', '--repeats', '1', "
        f"'--json', {str(out)!r}]\n"
        "try:\n    runpy.run_path('benchmarks/gpu_throughput.py', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('LOADED', sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'prefect', 'mlflow'}))"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LOADED []" in done.stdout
    result = json.loads(out.read_text())
    assert [row["precision"] for row in result["rows"]] == ["fp32", "bf16"]
    for row in result["rows"]:
        assert row["bare_samples_per_s"] > 0 and row["gpuflow_samples_per_s"] > 0
        assert row["telemetry"]["perf/samples_per_s"] > 0
    assert "gpuflow/bare" in done.stdout and "bf16 / fp32" in done.stdout


def test_gpu_benchmark_measures_the_gpu_example():
    from benchmarks.gpu_throughput import GPU_SHAPE

    spec = load_spec(REPO / "experiments" / "chargpt-gpu.yaml")
    assert {**spec.train.params, "batch_size": spec.train.batch_size} == GPU_SHAPE
    assert spec.compute.accelerators == "H100:1" and spec.precision == "bf16"


def test_summary_shows_the_last_epochs_telemetry():
    from gpuflow.tasks.tracking import telemetry_lines

    lines = "\n".join(
        telemetry_lines(
            {"val_accuracy": 0.97, "perf/samples_per_s": 1234.5, "perf/mfu_pct": 41.2, "perf/data_wait_pct": 3.25}
        )
    )
    assert "| throughput | 1,234.5 samples/s |" in lines and "| MFU | 41.2 % |" in lines
    assert "| waiting for data | 3.2 % of step time |" in lines and "val_accuracy" not in lines
    assert telemetry_lines({"val_accuracy": 0.97}) == []


# -- real runs: local Ray cluster, Ray Train, MLflow, under a real Prefect API ----------------------------------
def prefect_artifact_of(flow_run_id) -> str:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def read():
        async with get_client() as client:
            found = await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
            )
            return "\n".join(str(artifact.data) for artifact in found)

    return asyncio.run(read())


@pytest.mark.full
def test_chargpt_cpu_spec_trains_on_the_local_backend(prefect_server, tmp_path, gpuflow_home):
    """The shipped spec as a user runs it, `gpuflow run` in a project folder of its own: this is also its run among
    tests/test_shipped.py's shipped specs."""
    from mlflow import MlflowClient

    from tests.test_shipped import run_shipped

    [run] = run_shipped("chargpt-cpu.yaml", [], tmp_path, gpuflow_home)
    client = MlflowClient(f"sqlite:///{gpuflow_home}/mlflow.db")
    losses = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "val_loss"), key=lambda m: m.step)]
    assert len(losses) == 2 and losses[1] < losses[0] < 2.5  # from ln(32) = 3.5: it learns the sums' spelling
    tokens = client.get_metric_history(run.info.run_id, "perf/tokens_per_s")
    assert len(tokens) == 2 and all(m.value > 0 for m in tokens)
    assert run.data.metrics["perf/tokens_per_s"] == pytest.approx(64 * run.data.metrics["perf/samples_per_s"])
