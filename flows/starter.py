"""`gpuflow init`: a starter project in a folder of your own — a spec, a Ray Train loop and prefect.yaml.

    mkdir my-project && cd my-project && gpuflow init && gpuflow validate experiment.yaml && gpuflow run experiment.yaml
"""

from __future__ import annotations

import re
from pathlib import Path

LOOP_FILE = "train.py"
SPEC_FILE = "experiment.yaml"
PREFECT_FILE = "prefect.yaml"

# The loop is plain Ray Train and torch: gpuflow tracks every ray.train.report without any import of its own.
LOOP = '''"""A Ray Train per-worker loop: plain Ray Train and torch, no gpuflow import. gpuflow logs every
ray.train.report to MLflow (step = "epoch"), and records each checkpoint.

    gpuflow run experiment.yaml
"""

import os
import tempfile

import ray.train
import ray.train.torch
import torch
from torch import nn


def make_data(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y = 3x - 1 plus noise: replace with your own data, or set `data:` in the spec for Parquet via Ray Data."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, 1, generator=generator)
    return x, 3 * x - 1 + 0.05 * torch.randn(rows, 1, generator=generator)


def train_loop(config: dict) -> None:
    # data: a fixed seed per split, so every worker sees the same validation set
    train = torch.utils.data.TensorDataset(*make_data(2048, seed=0))
    x_val, y_val = make_data(512, seed=1)
    loader = ray.train.torch.prepare_data_loader(
        torch.utils.data.DataLoader(train, batch_size=config["batch_size"], shuffle=True))

    # model and optimizer; resume from the last checkpoint if this run was restarted
    model = ray.train.torch.prepare_model(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "state.pt"))
        getattr(model, "module", model).load_state_dict(state["model"])
        start = state["epoch"] + 1

    for epoch in range(start, config["epochs"]):
        if ray.train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            val_loss = nn.functional.mse_loss(model(x_val), y_val).item()
        metrics = {"epoch": epoch, "train_loss": loss.item(), "val_loss": val_loss}

        # rank 0 saves the checkpoint; every rank reports, so that the workers stay in step
        if ray.train.get_context().get_world_rank() == 0:
            with tempfile.TemporaryDirectory() as folder:
                torch.save({"epoch": epoch, "model": getattr(model, "module", model).state_dict()},
                           os.path.join(folder, "state.pt"))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
        else:
            ray.train.report(metrics)
'''

SPEC = '''# {name}: the loop in train.py on a local Ray cluster (2 CPU workers), tracked in .gpuflow/mlflow.db.
#   gpuflow validate experiment.yaml && gpuflow run experiment.yaml
name: {name}
train:
  loop: train:train_loop        # module:function in this folder, taking one argument (the config)
  epochs: 5
  batch_size: 64
  lr: 0.1
  params: {{}}                    # anything else the loop reads from its config
# data:                         # optional: Parquet streamed to the loop, ray.train.get_dataset_shard("train")
#   train: data/train.parquet
#   validation: data/validation.parquet
compute:
  backend: local                # local | skypilot (compute.accelerators: H100:1, tracking.uri, storage.checkpoints)
  num_nodes: 1
  workers_per_node: 2
limits:
  max_runtime_minutes: 15
'''

PREFECT = '''# Prefect deployments of this project: they run gpuflow's flow (installed with gpuflow, a module entrypoint).
#   gpuflow serve                  # serve them from this machine (needs PREFECT_API_URL), no work pool
#   gpuflow deploy                 # register them with the gpuflow-process work pool; then: prefect worker start --pool gpuflow-process
name: {name}
prefect-version: {prefect_version}

build: null
push: null
# A worker on any machine pulls this project at the commit `gpuflow deploy` ran at, and installs it
# (its pyproject.toml or requirements.txt, if any) before each run. `gpuflow serve` runs this folder as it is.
pull:
  - prefect.deployments.steps.git_clone:
      id: clone
      repository: "{{{{ $GPUFLOW_GIT_REMOTE }}}}"
      commit_sha: "{{{{ $GPUFLOW_GIT_COMMIT }}}}"
  - gpuflow.flows.pull.install_checkout:
      directory: "{{{{ clone.directory }}}}"

definitions:
  work_pools:
    process: &process_pool
      name: gpuflow-process
      work_queue_name: default
  # The Prefect UI form's defaults: experiment.yaml as it was at `gpuflow init` (or give spec_file in the form).
  specs:
    starter: &starter_spec
{spec_block}
deployments:
  - name: run-experiment
    description: "Run one experiment of this project: edit the spec in the form, or give spec_file (e.g. experiment.yaml)."
    entrypoint: gpuflow.flows.experiment:run_experiment
    tags: [gpuflow]
    parameters:
      spec: *starter_spec
    work_pool: *process_pool

  - name: reap-clusters
    description: "Every 10 minutes: down every gpuflow cluster whose flow run is over, and close stale MLflow runs."
    entrypoint: gpuflow.flows.reaper:reap_clusters
    tags: [gpuflow, reaper]
    schedules:
      - interval: 600
    work_pool: *process_pool
'''


def project_name(folder: Path) -> str:
    """The folder's name as a spec name (lowercase, digits and '-', starting with a letter)."""
    name = re.sub(r"[^a-z0-9]+", "-", folder.absolute().name.lower()).strip("-")
    name = name if name[:1].isalpha() else f"exp-{name}".rstrip("-")
    return name[:40].rstrip("-") or "my-experiment"


def init_project(folder: Path, force: bool = False) -> list[Path]:
    """Writes the starter files into the folder; refuses to overwrite any of them unless force."""
    import yaml
    from prefect import __version__ as prefect_version

    folder.mkdir(parents=True, exist_ok=True)
    name = project_name(folder)
    spec = SPEC.format(name=name)
    spec_block = "".join(f"      {line}\n" for line in yaml.safe_dump(yaml.safe_load(spec), sort_keys=False).splitlines())
    files = {
        folder / LOOP_FILE: LOOP,
        folder / SPEC_FILE: spec,
        folder / PREFECT_FILE: PREFECT.format(name=name, prefect_version=prefect_version, spec_block=spec_block),
    }
    existing = [path for path in files if path.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(str(p) for p in existing)} already exist; remove them or pass --force")
    for path, text in files.items():
        path.write_text(text)
    return list(files)
