"""Before any cluster exists: check the spec, and put the data where the cluster can read it."""

from prefect import get_run_logger, task

from cluster.spec import ExperimentSpec, absolute_uri, on_sys_path, readable, resolve, validate_spec
from tasks.cost import check_budget


@task(name="validate")
def validate(spec: ExperimentSpec) -> ExperimentSpec:
    """Fails with every problem listed (field, value, fix) before anything is started or billed."""
    spec = validate_spec(spec)
    estimate = check_budget(spec)  # refuses here, before any cluster exists
    get_run_logger().info(
        f"spec {spec.name!r} is valid: backend={spec.compute.backend} nodes={spec.compute.num_nodes} "
        f"workers={spec.compute.num_workers} precision={spec.precision}; "
        f"price {estimate.describe()}, at most ${estimate.max_runtime_cost_usd(spec):.2f} in limits.max_runtime_minutes"
    )
    return spec


@task(name="stage-data", retries=2, retry_delay_seconds=[2, 10])
def stage_data(spec: ExperimentSpec) -> dict[str, str | None]:
    """Writes the Parquet data with data.generate when it is missing; returns the resolved locations."""
    logger = get_run_logger()
    uris = {"train": absolute_uri(spec.data.train),
            "validation": absolute_uri(spec.data.validation) if spec.data.validation else None}
    missing = [uri for uri in uris.values() if uri and not readable(uri)]
    if missing and spec.data.generate:
        logger.info(f"writing data with {spec.data.generate} to {', '.join(missing)}")
        with on_sys_path(spec.workdir):
            resolve(spec.data.generate)(uris["train"], uris["validation"])
        missing = [uri for uri in uris.values() if uri and not readable(uri)]
    if missing:
        raise FileNotFoundError(f"data: cannot read Parquet at {', '.join(missing)}")
    logger.info(f"data ready: {uris}")
    return uris
