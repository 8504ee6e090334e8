"""The baseline: the digits training as a bare Ray Train script (its own ray.init, no Prefect, no MLflow).

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

from gpuflow.cluster.job import loop_config  # noqa: E402
from gpuflow.cluster.spec import load_spec, resolve  # noqa: E402

spec = load_spec(sys.argv[1], sys.argv[2:])
temp_dir = tempfile.mkdtemp(prefix="gf-bare-", dir="/tmp")
ray.init(num_cpus=spec.compute.num_workers, include_dashboard=False, _temp_dir=temp_dir,
         runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
print(f"[bench] cluster up {time.time():.3f}", flush=True)
trainer = TorchTrainer(
    resolve(spec.train.loop),
    train_loop_config=loop_config(spec),
    scaling_config=ray.train.ScalingConfig(num_workers=spec.compute.num_workers, resources_per_worker={"CPU": 1}),
    run_config=ray.train.RunConfig(name="bare", storage_path=tempfile.mkdtemp()),
)
result = trainer.fit()
ray.shutdown()
print(f"[bench] val_accuracy {result.metrics['val_accuracy']:.4f}", flush=True)
