"""Makes sure the spec's Parquet data exists where this process runs (the flow's machine, or a cloud node)."""

from gpuflow.cluster.spec import ExperimentSpec, readable
from gpuflow.cluster.usercode import on_sys_path, resolve


def ensure_data(spec: ExperimentSpec) -> dict[str, str | None]:
    """Runs data.generate when the data is missing; returns the resolved locations or says what is unreadable.

    A spec without `data` (a loop that reads its own) has nothing to stage."""
    if spec.data is None:
        return {"train": None, "validation": None}
    spec = spec.anchored()
    uris = {"train": spec.data.train, "validation": spec.data.validation}
    missing = [uri for uri in uris.values() if uri and not readable(uri)]
    if missing and spec.data.generate:
        with on_sys_path(spec.workdir):
            resolve(spec.data.generate)(uris["train"], uris["validation"])
        missing = [uri for uri in uris.values() if uri and not readable(uri)]
    if missing:
        raise FileNotFoundError(f"data: cannot read Parquet at {', '.join(missing)}")
    return uris
