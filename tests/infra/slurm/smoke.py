"""Smoke test of the harness: real sky.launch -> Ray job -> tail logs -> job status -> down.

    source tests/infra/slurm/env.sh      # after setup.sh (or: harness.start())
    python tests/infra/slurm/smoke.py [--node-env=prebuilt|pip|none] [--cluster NAME]

--node-env:
  prebuilt  task setup activates $GPUFLOW_NODE_VENV (harness.build_node_venv); fast.
  pip       task setup pip-installs ray[train]==2.60.0 + torch==2.13.0(+cpu from the local
            wheel dir) into SkyPilot's default user env (~/sky-user-env), like a cloud node.
  uv        the same with `uv pip install` (SkyPilot's uv cache for the user persists).
  none      only `pip install ray==2.60.0` (what the reference recipe did).
Prints TIMING lines and SMOKE_RESULT PASS/FAIL.
"""
import argparse
import io
import os
import sys
import time

import sky

RUN = r"""
set -e
echo "hello from $(hostname) job=$SLURM_JOB_ID user=$(id -un) python=$(which python)"
RT=/tmp/ray_gpuflow_smoke_$SLURM_JOB_ID
trap 'ray stop --force >/dev/null 2>&1 || true; rm -rf $RT' EXIT
T0=$(date +%s.%N)
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --port=6390 --num-cpus=1 \
  --include-dashboard=false --dashboard-port=8390 --temp-dir=$RT --disable-usage-stats >/dev/null
T1=$(date +%s.%N)
# explicit address: address="auto" can attach to ANOTHER Ray cluster on this machine
# (it reads /tmp/ray/ray_current_cluster, not --temp-dir) -- seen in the first run.
export RAY_ADDRESS=127.0.0.1:6390
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python - <<'PY'
import ray
ray.init()  # RAY_ADDRESS
nodes = [n for n in ray.nodes() if n["Alive"]]
print("RAY_NODES", len(nodes), [n["NodeManagerAddress"] for n in nodes], "ray", ray.__version__)
try:
    import torch
    print("TORCH", torch.__version__)
except ImportError:
    print("TORCH none")
PY
T2=$(date +%s.%N)
ray stop --force >/dev/null 2>&1
T3=$(date +%s.%N)
python -c "print('NODE_TIMING ray_start=%.1fs driver=%.1fs ray_stop=%.1fs' % ($T1-$T0, $T2-$T1, $T3-$T2))"
echo SMOKE_RUN_OK
"""

SETUPS = {
    "none": 'T=$(date +%s); pip install -q "ray==2.60.0"; echo "SETUP_SECONDS $(( $(date +%s) - T ))"',
    # PIP_FIND_LINKS (local wheel dir) is exported by the skyci user's ~/.profile (setup.sh);
    # `+cpu` pins the local wheel: a bare torch==2.13.0 could resolve to the CUDA build on PyPI.
    "pip": ('T=$(date +%s); which python pip; echo "find-links=$PIP_FIND_LINKS"; '
            'pip install -q "torch==2.13.0+cpu" "ray[train]==2.60.0"; '
            'echo "SETUP_SECONDS $(( $(date +%s) - T ))"'),
    # same, with uv into the same env: reuses SkyPilot's per-user uv cache (/tmp/uv_cache_<uid>),
    # which survives across clusters (pip's cache lives in the per-cluster $HOME and does not).
    "uv": ('T=$(date +%s); export PATH=$HOME/.local/bin:$PATH; echo "UV_CACHE_DIR=$UV_CACHE_DIR"; '
           'UV_CACHE_DIR=${UV_CACHE_DIR:-/tmp/uv_cache_$(id -u)} uv pip install -q --python "$(which python)" '
           '"torch==2.13.0+cpu" "ray[train]==2.60.0"; echo "SETUP_SECONDS $(( $(date +%s) - T ))"'),
    "prebuilt": 'test -x "$GPUFLOW_NODE_VENV/bin/python" && echo "using $GPUFLOW_NODE_VENV"',
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--node-env", default="prebuilt", choices=sorted(SETUPS))
    ap.add_argument("--cluster", default="gpuflow-smoke")
    ap.add_argument("--infra", default=os.environ.get("GPUFLOW_SLURM_INFRA", "slurm/skyci"))
    ap.add_argument("--autostop", type=int, default=10, help="idle minutes to autostop")
    a = ap.parse_args()

    envs = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    run = RUN
    if a.node_env == "prebuilt":
        nv = os.environ.get("GPUFLOW_NODE_VENV")
        if not nv:
            print("GPUFLOW_NODE_VENV not set (build it with harness.build_node_venv)")
            return 2
        envs["GPUFLOW_NODE_VENV"] = nv
        run = f'source "$GPUFLOW_NODE_VENV/bin/activate"\n{RUN}'
    task = sky.Task(name="gpuflow-smoke", setup=SETUPS[a.node_env], run=run, envs=envs)
    task.set_resources(sky.Resources(infra=a.infra, cpus=1, memory=2))

    t = {}
    t0 = time.time()
    job_id, handle = sky.stream_and_get(sky.launch(
        task, cluster_name=a.cluster, down=True, idle_minutes_to_autostop=a.autostop))
    t["launch (provision + runtime + task setup + submit)"] = time.time() - t0
    print(f"job_id={job_id} handle={type(handle).__name__}")

    t1 = time.time()
    buf = io.StringIO()
    rc = sky.tail_logs(a.cluster, job_id, follow=True, output_stream=buf)
    t["job (run + log tail)"] = time.time() - t1
    logs = buf.getvalue()
    print("===== job logs =====\n" + logs + "\n===== end =====")
    st = sky.get(sky.job_status(a.cluster, [job_id]))
    print("tail_logs rc =", rc, "job status =", st)

    t2 = time.time()
    sky.stream_and_get(sky.down(a.cluster))
    t["down"] = time.time() - t2
    t["total"] = time.time() - t0
    remaining = [r["name"] for r in sky.get(sky.status())]
    print("clusters after down:", remaining)
    for k, v in t.items():
        print(f"TIMING {k}: {v:.1f}s")
    status = st.get(job_id) if isinstance(st, dict) else None
    ok = (rc == 0 and "SMOKE_RUN_OK" in logs and "RAY_NODES 1" in logs
          and status is not None and str(status).endswith("SUCCEEDED") and a.cluster not in remaining)
    print("SMOKE_RESULT", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
