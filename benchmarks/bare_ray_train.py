"""The baseline: the digits training as a bare Ray Train script (its own ray.init, no Prefect, no MLflow),
reading the same Parquet through Ray Data, split across the workers as gpuflow's job does.

    python benchmarks/bare_ray_train.py experiments/digits.yaml
"""

import os
import sys
import tempfile
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only, as the local backend does
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
sys.path.insert(0, os.getcwd())

import ray  # noqa: E402
import ray.train  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402
from ray.train.v2.api.callback import UserCallback  # noqa: E402

from gpuflow.cluster.job.ingest import SplitInMemory  # noqa: E402
from gpuflow.cluster.job.trainer import datasets_of, loop_config  # noqa: E402
from gpuflow.cluster.spec import load_spec  # noqa: E402
from gpuflow.cluster.usercode import resolve  # noqa: E402


class PrintEpochs(UserCallback):
    """What a user of bare Ray Train would watch: each report, as a line (the benchmark times the first and last)."""

    def after_report(self, run_context, metrics, checkpoint) -> None:
        print(
            f"[gpuflow] epoch {metrics[0].get('epoch')}: " + " ".join(f"{k}={v}" for k, v in metrics[0].items()),
            flush=True,
        )


spec = load_spec(sys.argv[1], sys.argv[2:])
temp_dir = tempfile.mkdtemp(prefix="gf-bare-", dir="/tmp")
ray.init(
    num_cpus=spec.compute.num_workers + 1,  # one for Ray Data's reads, as the local backend gives
    include_dashboard=False,
    _temp_dir=temp_dir,
    runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}},
)
print(f"[bench] cluster up {time.time():.3f}", flush=True)
trainer = TorchTrainer(
    resolve(spec.train.loop),
    train_loop_config=loop_config(spec),
    datasets=datasets_of(spec),
    dataset_config=SplitInMemory(),  # the ingest gpuflow uses: the benchmark compares orchestration alone
    scaling_config=ray.train.ScalingConfig(num_workers=spec.compute.num_workers, resources_per_worker={"CPU": 1}),
    run_config=ray.train.RunConfig(name="bare", storage_path=tempfile.mkdtemp(), callbacks=[PrintEpochs()]),
)
result = trainer.fit()
ray.shutdown()
print(f"[bench] val_accuracy {result.metrics['val_accuracy']:.4f}", flush=True)
