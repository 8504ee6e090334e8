"""The run's bill: each cluster it had at its own price, from its provision request to the end of its teardown.

meter = Meter(hourly_cost(spec))      # priced at the dearest option that may launch, until one does
meter.launched(hourly_usd, price, option)
meter.resized(live_nodes)             # an elastic run lost nodes and trains on: billed for those left
meter.cost()                          # {"cost_usd": ..., "gpu_hours": ..., "cluster_hours": ..., ...}
"""

from __future__ import annotations

import time

from gpuflow.cluster.cost.pricing import USER_RATE, Estimate, launched_price


class Meter:
    def __init__(self, price: Estimate, requested_at: float | None = None):
        self.price = price
        self.requested_at = requested_at or time.time()  # the bill runs from the provision request
        self.attempts: list[dict] = []  # each cluster before the current one: its option, price, seconds, cost
        self.option = "planned"  # the current cluster's option, once it launched: "2: slurm/lab A100:1 on-demand"
        self._attempt_started = self.requested_at  # the current cluster's provision request
        self._resizes: list[tuple[float, int]] = []  # (when, nodes alive from then): an elastic run's losses

    def hourly_usd(self) -> float:
        return self.price.hourly_usd

    def launched(
        self, hourly_usd: float | None = None, price: Estimate | None = None, option: str | None = None
    ) -> None:
        """Meters the cluster at the price of the option that launched (`price`), or at what the backend says it
        costs, unless the user priced it."""
        self.price, self.option = price or self.price, option or self.option
        if hourly_usd is not None and not self.price.source.endswith(USER_RATE):
            self.price = launched_price(self.price, hourly_usd)

    def not_billed_until(self, when: float) -> None:
        """No cluster existed until `when` (a launch that found no capacity): the bill of this attempt starts there."""
        self._attempt_started = when

    def resized(self, live_nodes: int, when: float | None = None) -> None:
        """The current cluster has `live_nodes` nodes from `when` (now) on: an elastic run that lost some is billed
        for those left."""
        self._resizes.append((when or time.time(), live_nodes))

    def live_hourly_usd(self) -> float:
        """What the current cluster costs an hour at its live size."""
        if not self._resizes:
            return self.price.hourly_usd
        return self.price.per_node_cost_usd(self._resizes[-1][1] * 3600)

    def relaunched(self, price: Estimate | None = None, requested_at: float | None = None) -> dict:
        """The current cluster ended and another is requested (at `requested_at`, a replacement asked for on a spot
        notice: both billed meanwhile), metered at `price` until it launches. Returns the attempt that ended: its
        option, price, seconds, cost and GPU-hours."""
        now = time.time()
        self.attempts.append(self._attempt(now))
        self._attempt_started, self.option, self._resizes = requested_at or now, "planned", []
        self.price = price or self.price
        return self.attempts[-1]

    def unused(self, requested_at: float, ended: float) -> None:
        """A replacement cluster that was never used (the run ended without the loss its notice announced), billed
        from its request to the end of its teardown, at the current price."""
        self.attempts.append({**self._full_size(max(0.0, ended - requested_at)), "option": "replacement, unused"})

    def cost(self, ended: float | None = None) -> dict[str, float]:
        """What the run's clusters cost up to `ended` (now): the ones before, and the current one."""
        attempts = self.all_attempts(ended)
        return {
            "cost_usd": sum(a["cost_usd"] for a in attempts),
            "cluster_hours": sum(a["seconds"] for a in attempts) / 3600,
            "gpu_hours": sum(a["gpu_hours"] for a in attempts),
            "hourly_cost_usd": self.live_hourly_usd(),
        }

    def all_attempts(self, ended: float | None = None) -> list[dict]:
        """Every cluster of the run, the current one last, each with its option, price, seconds, cost, GPU-hours."""
        return [*self.attempts, self._attempt(ended or time.time())]

    def _full_size(self, seconds: float) -> dict:
        price = self.price
        return {
            "option": self.option,
            "hourly_usd": price.hourly_usd,
            "seconds": seconds,
            "cost_usd": price.cost_usd(seconds),
            "gpu_hours": seconds / 3600 * price.gpus_per_node * price.num_nodes,
        }

    def _attempt(self, ended: float) -> dict:
        price, attempt = self.price, self._full_size(max(0.0, ended - self._attempt_started))
        if self._resizes:
            node_seconds = sum(
                nodes * seconds
                for seconds, nodes in seconds_at_sizes(self._attempt_started, ended, price.num_nodes, self._resizes)
            )
            attempt.update(
                cost_usd=price.per_node_cost_usd(node_seconds), gpu_hours=node_seconds / 3600 * price.gpus_per_node
            )
        return attempt


def seconds_at_sizes(
    started: float, ended: float, num_nodes: int, resizes: list[tuple[float, int]]
) -> list[tuple[float, int]]:
    """(seconds, nodes) of each stretch of a cluster's life from `started` to `ended`: `num_nodes` until the first
    resize, then each resize's node count until the next."""
    stretches, since, nodes = [], started, num_nodes
    for when, live in sorted(resizes):
        when = min(max(when, started), ended)
        stretches.append((when - since, nodes))
        since, nodes = when, live
    stretches.append((max(0.0, ended - since), nodes))
    return [(seconds, nodes) for seconds, nodes in stretches if seconds > 0]
