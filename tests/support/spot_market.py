"""A cloud's spot market in front of this machine's Ray clusters: a deadline's run on real Ray, real checkpoints.

What cannot run here is the cloud's side: spot capacity that comes and goes, and its prices. The clusters are real
(LocalBackend: a Ray cluster per launch, the job on it, its checkpoints in the run's storage). As SkyPilot does for
the flow: a launch on a spot option while the market has none fails with NoCapacity (spot=True, each option and its
reason); a launch that succeeds starts the job it is given and says in its handle which option launched and its
hourly price (the catalog's, as SkyPilot's launched resources do); the job's log begins with the node's "setup
finished" line, from which the flow counts the job's time.

The market's script: spot is there at first; a test's preemption sets `spot` False as it kills the spot cluster; it
is back once the run has launched on on-demand, so that a run behind its pace goes on-demand and, once ahead again,
has spot to go back to.
"""

from __future__ import annotations

from gpuflow.cluster.backends import ClusterHandle, Job, NoCapacity
from gpuflow.cluster.backends.base import LineReader
from gpuflow.cluster.backends.local import LocalBackend
from gpuflow.cluster.cost.pricing import option_price
from gpuflow.cluster.protocol import SETUP_DONE
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.spec.options import compute_options


class SpotMarket:
    def __init__(self):
        self.spot = True
        self.launched: list[str] = []  # each cluster launched: "spot" or "on-demand", in order

    def backend(self) -> SpotMarketBackend:
        return SpotMarketBackend(self)


class SpotMarketBackend(LocalBackend):
    """The SkyPilot backend as the flow sees it (name, NoCapacity, the launched option), on local Ray clusters."""

    name = "skypilot"
    starts_job_at_launch = True

    def __init__(self, market: SpotMarket):
        super().__init__()
        self.market = market

    def launch(self, spec: ExperimentSpec, cluster_name: str, job: Job | None = None) -> ClusterHandle:
        [option] = compute_options(spec.compute)  # the spec's spot option, or its on-demand twin
        if option.use_spot and not self.market.spot:
            where = f"option {option.index} ({option.describe()})"
            raise NoCapacity(f"{where}: no spot capacity", [(where, "no spot capacity")], spot=True)
        handle = super().launch(spec, cluster_name)
        handle.info = {
            **handle.info,
            "option": option.index,
            "option_text": option.describe(),
            "hourly_cost_usd": option_price(spec, option).hourly_usd,
            "launched": {
                "infra": option.infra,
                "accelerators": option.accelerators,
                "spot": str(option.use_spot).lower(),
            },
        }
        if job is not None:
            handle.info["job_id"] = super().exec(handle, spec, job.run_name, job.env)
        self.market.launched.append("spot" if option.use_spot else "on-demand")
        if not option.use_spot:
            self.market.spot = True
        return handle

    def exec(self, handle: ClusterHandle, spec: ExperimentSpec, run_name: str, env: dict[str, str]) -> str:
        """The job the launch started, else a new one on the cluster."""
        return handle.info.pop("job_id", None) or super().exec(handle, spec, run_name, env)

    def tail_logs(self, handle: ClusterHandle, job_id: str, read: LineReader) -> int:
        read(f"{SETUP_DONE}: starting Ray on {self.record(handle.name)['shape']['num_nodes']} node(s)")
        return super().tail_logs(handle, job_id, read)
