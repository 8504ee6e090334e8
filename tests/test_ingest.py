"""How the workers share the data (cluster/job/ingest.py): a table in memory is split into equal, disjoint parts, the
same every epoch, by the controller where every dataset is such a table; a dataset read lazily still streams,
split as Ray Data does. Real Ray Train, real local cluster.
(What the in-memory split saves, Ray Data's coordinator actors, is measured by benchmarks/overhead.py.)"""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gpuflow.cluster.backends.local import LocalBackend, ray_env
from gpuflow.cluster.spec import parse_spec
from tests.support.processes import processes_of
from tests.support.repo import REPO

ROWS = 100


@pytest.mark.full
def test_each_worker_reads_an_equal_disjoint_share_of_each_dataset(gpuflow_home, tmp_path):
    pq.write_table(pa.table({"id": list(range(ROWS, 2 * ROWS))}), tmp_path / "streamed.parquet")
    spec = parse_spec(
        {
            "train": {"loop": "tests.loops.plain:record_shards"},
            "workdir": str(REPO),
            # three CPUs: two workers and one for Ray Data's read tasks
            "compute": {"workers_per_node": 3},
            "limits": {"orphan_grace_minutes": 30},
        }
    )
    backend = LocalBackend()
    handle = backend.launch(spec, "gpuflow-1b9e570000000000000000000000000a")
    try:
        driver = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.support.shards_driver",
                handle.address,
                str(tmp_path),
                str(tmp_path / "streamed.parquet"),
                str(ROWS),
            ],
            cwd=REPO,
            env=ray_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
    finally:
        backend.down(handle.name)
    both = {"in_memory": range(ROWS), "streamed": range(ROWS, 2 * ROWS)}
    for run, datasets in (("in_store", {"in_memory": range(ROWS)}), ("mixed", both)):
        seen = {
            (rank, epoch): json.loads((tmp_path / run / f"{rank}-{epoch}.json").read_text())
            for rank in (0, 1)
            for epoch in (0, 1)
        }
        for name, ids in datasets.items():
            for epoch in (0, 1):
                first, second = seen[(0, epoch)][name], seen[(1, epoch)][name]
                assert len(first) == len(second) == ROWS // 2, (run, name, epoch)
                assert sorted(first + second) == list(ids), (run, name, epoch)
        # the in-memory split is fixed: each worker has the same share every epoch (a loop shuffles within it)
        assert all(seen[(rank, 0)]["in_memory"] == seen[(rank, 1)]["in_memory"] for rank in (0, 1)), run
    assert processes_of(gpuflow_home) == []
