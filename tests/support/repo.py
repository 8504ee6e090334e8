"""The repository, and the fields of specs built in tests."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
A_LOOP = {"train": {"loop": "experiments.digits:train_loop"}}  # the one required field, for specs built in tests
DIGITS_DATA = {
    "train": ".gpuflow/data/digits/train.parquet",
    "validation": ".gpuflow/data/digits/validation.parquet",
    "generate": "experiments.digits:write_parquet",
}


def with_loop(fields: dict) -> dict:
    """`fields` with train.loop filled in (the digits loop) unless they give one."""
    train = fields.get("train")
    if isinstance(train, dict) and "loop" not in train:
        return {**fields, "train": {**A_LOOP["train"], **train}}
    return {**A_LOOP, **fields} if "train" not in fields else fields
