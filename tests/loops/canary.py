"""A training loop for tests/test_secrets_nowhere.py: the digits loop, after it checks the canary secret reached it."""

import hashlib
import os

from experiments import digits


def train_loop(config: dict) -> None:
    # Only the hash travels in envs (logged): the secret itself must arrive through `secrets`.
    seen = hashlib.sha256(os.environ.get("CANARY_API_TOKEN", "").encode()).hexdigest()
    if seen != os.environ.get("CANARY_SHA256"):
        raise RuntimeError("the canary secret did not reach the training loop")
    digits.train_loop(config)
