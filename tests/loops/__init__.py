"""Training loops the tests run, and how a test names them."""

PACED_LOOP = "tests.loops.paced:train_loop"  # named here, not imported: importing it loads torch and Ray Train
PACED_LOOP_IN_MEMORY = "tests.loops.paced:without_ray_data"  # the same, for a run with no data section
HANGING_LOOP = "tests.loops.hanging:train_loop"  # reports train.params.hang_after epochs, then hangs
TUNABLE_LOOP = "tests.loops.tunable:train_loop"  # a score known in advance from lr and hidden: sweep tests
STEPPED_LOOP = "tests.loops.stepped:train_loop"  # digits at a step every train.params.step_pace_s: spot notices
PLAIN_LOOP = "tests.loops.plain:epochs_with_checkpoints"  # Ray Train alone, no data: params offset (and pace_s)


# A run that mostly waits (an epoch a second or slower, kept alive for a fault or a limit) needs no report taken up
# within 0.1 s, the job's default for short epochs: Ray Train's controller polls its workers every half second, which
# spares the run about a tenth of its CPU-seconds (the spec's envs reach the job's driver: cluster/job/__main__.py).
WAITING_RUN_ENVS = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
WAITING_RUN_OVERRIDES = [f'envs.{name}="{value}"' for name, value in WAITING_RUN_ENVS.items()]


def paced_overrides(pace_s: float) -> list[str]:
    """The spec overrides (`--set`) that make a digits run train the paced loop, an epoch every `pace_s` seconds, with
    no data section: its digits in memory, nothing read or split by Ray Data (PACED_LOOP_IN_MEMORY); a waiting run's
    polling (WAITING_RUN_ENVS)."""
    return [
        f"train.loop={PACED_LOOP_IN_MEMORY}",
        "data=null",
        f"train.params.pace_s={pace_s:g}",
        *WAITING_RUN_OVERRIDES,
    ]
