"""Rebuilds the Parquet spot traces beside this file from the SkyNomad NSDI '27 artifact's originals
(andylizf/skynomad-artifact, Apache-2.0: LICENSE and NOTICE here).

    python benchmarks/traces/convert.py ORIGINALS

ORIGINALS holds `aws-v100-2023-02-15/*.csv` (`date,availability`, 1 = a spot launch succeeded) and
`gcp-h100-16-multiregion-2025-10.tar.gz` (a JSON per zone, `<zone>_h100_16/full.json`, its `data` 1 = preempted or
unavailable). Both become one long table: zone, step, available (true = spot can be had); the GCP one also carries
each zone's spot and on-demand price (USD an hour, from the JSON's metadata).
"""

from __future__ import annotations

import argparse
import csv
import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
AWS = "aws-v100-2023-02-15"
GCP = "gcp-h100-16-multiregion-2025-10"


def aws(folder: Path) -> pa.Table:
    zones, steps, available = [], [], []
    for path in sorted(folder.glob("*.csv")):
        zone = path.name.split("_")[0]
        with path.open() as file:
            for step, row in enumerate(csv.DictReader(file)):
                zones.append(zone)
                steps.append(step)
                available.append(row["availability"].strip() == "1")
    return pa.table(
        {
            "zone": pa.array(zones).dictionary_encode(),
            "step": pa.array(steps, pa.int32()),
            "available": pa.array(available),
        }
    )


def gcp(tarball: Path) -> pa.Table:
    columns = {"zone": [], "step": [], "available": [], "spot_usd_per_h": [], "on_demand_usd_per_h": []}
    with tarfile.open(tarball) as archive:
        members = sorted((m for m in archive.getmembers() if m.name.endswith("/full.json")), key=lambda m: m.name)
        for member in members:
            trace = json.load(archive.extractfile(member))
            meta = trace["metadata"]
            price = meta["price_info"]
            for step, unavailable in enumerate(trace["data"]):
                columns["zone"].append(meta["zone"])
                columns["step"].append(step)
                columns["available"].append(not unavailable)
                columns["spot_usd_per_h"].append(float(trace["prices"][step]))
                columns["on_demand_usd_per_h"].append(float(price["on_demand_price"]))
    table = {name: pa.array(values) for name, values in columns.items()}
    table["zone"] = table["zone"].dictionary_encode()
    table["step"] = table["step"].cast(pa.int32())
    return pa.table(table)


def write(table: pa.Table, name: str, step_s: int, source: str) -> Path:
    path = HERE / f"{name}.parquet"
    metadata = {b"step_s": str(step_s).encode(), b"source": source.encode()}
    # steps count up within a zone and availability comes in runs: delta and run-length encodings keep them small
    encodings = {"step": "DELTA_BINARY_PACKED", "available": "RLE"}
    pq.write_table(
        table.replace_schema_metadata(metadata),
        path,
        compression="zstd",
        compression_level=19,
        use_dictionary=["zone"],
        column_encoding=encodings,
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("originals", type=Path, help="the folder holding the artifact's trace files")
    originals = parser.parse_args().originals
    origin = "andylizf/skynomad-artifact (tag nsdi27-ae), Apache-2.0"
    for path in (
        write(aws(originals / AWS), AWS, 195, f"{origin}: {AWS}/*.csv"),
        write(gcp(originals / f"{GCP}.tar.gz"), GCP, 600, f"{origin}: {GCP}.tar.gz, */full.json"),
    ):
        print(f"{path.relative_to(HERE.parents[1])}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
