"""`gpuflow run`: one experiment from this terminal. Prefect's API (a temporary one, the warm stack's, or a server),
the console, a cluster warmed while the flow starts, the flow run itself, and the summary a person reads.

    gpuflow run experiments/digits.yaml [-v] [--set field=value ...]
    gpuflow run --deployment run-experiment/run-experiment [--set ...]   # a run of a served deployment, as yours
    gpuflow rerun RUN [--dry-run] [--on N|GPU:COUNT] [--set ...]   # a run again, as it ran (cluster/rerun/)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from gpuflow.cluster.config import reuse_mode, stack_idle_minutes, stack_mode
from gpuflow.cluster.spec import check_entrypoints, load_spec, validate_spec
from gpuflow.cluster.util.preload import import_in_background
from gpuflow.flows.cli import add_overrides
from gpuflow.flows.cli.console import end_live_line, print_summary
from gpuflow.flows.cli.stack import leave_a_stack
from gpuflow.flows.local_stack.prefect_api import prefect_api_answers, prefect_api_up, temporary_api_launched


def add_parser(commands, name: str) -> None:
    if name == "rerun":
        return add_rerun_parser(commands, name)
    command = commands.add_parser(name, help="run an experiment: provision, train, track, tear down")
    command.add_argument("spec", nargs="?", help="experiment spec (YAML)")
    command.add_argument(
        "--deployment",
        metavar="FLOW/NAME",
        help="instead: start a run of this deployment (served elsewhere), tagged with your MLflow user",
    )
    command.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show the job's every line here (Ray's, MLflow's), not only gpuflow's progress",
    )
    command.add_argument(
        "--force",
        "--from-scratch",
        dest="force",
        action="store_true",
        help="train from scratch, even if a finished run has the same code, data and training fields (else it is "
        "reused) or the same with fewer epochs (else it is continued from its last checkpoint)",
    )
    add_overrides(command, "override a spec field, e.g. --set train.lr=0.01 (repeatable)")


def add_rerun_parser(commands, name: str) -> None:
    command = commands.add_parser(
        name,
        help="run a run again as it ran: its commit and uncommitted changes, its spec, "
        "its data checked by digest; linked to it in MLflow",
    )
    command.add_argument("run", help="the MLflow run id, or the Prefect flow run id, of the run to rerun")
    command.add_argument(
        "--tracking-uri",
        help="where the run is tracked (default: the local store under "
        "GPUFLOW_HOME, then the tracking servers the Prefect API knows)",
    )
    add_overrides(command, "override a field of the run's spec, as gpuflow run does (repeatable)")
    command.add_argument(
        "--on",
        metavar="N|GPU:COUNT",
        help="other hardware: compute option N alone (as gpuflow "
        "plan numbers them), or every option on this accelerator, e.g. H100:1",
    )
    command.add_argument("--dry-run", action="store_true", help="say what would run and what differs; launch nothing")
    command.add_argument("--allow-data-change", action="store_true", help="rerun on the data as it is now")
    command.add_argument(
        "--allow-unrecorded-changes",
        action="store_true",
        help="rerun the commit alone when the run's uncommitted changes were not recorded",
    )
    command.add_argument("-v", "--verbose", action="store_true", help="show the job's every line here")


def run(args: argparse.Namespace) -> int:
    from gpuflow.flows.reconcile.overdue import ask_for_a_pass_if_overdue

    ask_for_a_pass_if_overdue()  # on a team's server whose serves are all down, dead runs are still ended
    if args.command == "rerun":
        return rerun(args)
    if args.deployment:
        from gpuflow.flows.deployments.trigger import NoSuchDeployment, trigger
        from gpuflow.flows.run_tags import flow_run_ui_url

        if args.spec:  # the deployment runs its own spec: a file here would be silently not what ran
            print(
                f"gpuflow run: --deployment runs the deployment's own spec, not {args.spec}; change its fields with "
                f"--set, or run the file itself: gpuflow run {args.spec}",
                file=sys.stderr,
            )
            return 2
        try:
            flow_run_id = trigger(args.deployment, args.overrides)
        except NoSuchDeployment as exc:
            print(f"gpuflow run: {exc}", file=sys.stderr)
            return 2
        print(f"gpuflow: follow it with `gpuflow status`, or at {flow_run_ui_url(flow_run_id) or 'the Prefect UI'}")
        return 0
    if not args.spec:
        print("gpuflow run: give a spec file, or --deployment FLOW/NAME", file=sys.stderr)
        return 2
    return run_spec(load_spec(args.spec, args.overrides), args.verbose, force=args.force)


def interrupt_on_sigterm() -> None:
    """SIGTERM (a scheduler, `kill`) ends the run like Ctrl-C: teardown runs before the process exits. (While the flow
    runs, Prefect's own handler does the same, raising TerminationSignal.)"""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def stopped(exc: BaseException | None) -> bool:
    """Whether a signal or Ctrl-C is what ended the run, anywhere in the exception's chain: the flow's call to a gone
    API that failed as the run was stopped raises the API's error."""
    from prefect.exceptions import TerminationSignal

    from gpuflow.cluster.util.errors import caused_by

    return caused_by(exc, (KeyboardInterrupt, TerminationSignal))


def prewarm_cluster(spec) -> str | None:
    """A local Ray cluster takes seconds to start: the warm stack's spare is claimed, or one starts as soon as the spec
    is valid, while Prefect's API starts and the flow run begins. Returns its name (the flow's provision step adopts
    it), if any."""
    if spec.compute.backend != "local":
        return None
    from gpuflow.cluster.backends.local import LocalBackend, shape_of
    from gpuflow.flows.local_stack import stack

    if stack.read_stack():
        stack.want_shape(shape_of(spec))  # the stack's next spare: one like this run's
    return LocalBackend().prewarm(spec)


def flow_imports(spec) -> list[str]:
    """What the flow run imports once it starts, beyond the flow's own modules: MLflow's database store for a
    sqlite:// tracking URI and SkyPilot for the skypilot backend: seconds each, started early."""
    modules = []
    if (spec.tracking_uri or "").startswith("sqlite:"):
        modules.append("mlflow.store.tracking.sqlalchemy_store")
    if spec.compute.backend == "skypilot":
        modules.append("sky")
    return modules


def exit_without_prefect(spec, outcome: str, log_file, interrupted: bool = False) -> None:
    """Ends this process when Prefect's API went away mid-run (its server stopped, the warm stack killed).

    The flow's teardown has run here by then (the cluster is down, the MLflow run closed), but Prefect's log and event
    workers would still drain at exit, each retrying the API for minutes: the run's outcome is printed, then the
    process exits without them. The watcher of a temporary API stops its server, as after any exit."""
    from prefect.settings import PREFECT_API_URL

    lost = f"{'interrupted and ' * interrupted}lost Prefect's API ({PREFECT_API_URL.value()} stopped answering)"
    print(
        f"\ngpuflow: {spec.name} {lost}: {outcome}\n"
        f"  its cluster was torn down and its MLflow run closed here: experiment {spec.experiment_name!r} in "
        f"{spec.tracking_uri} says how training ended; Prefect's record of the run stops where its API went",
        file=sys.stderr,
    )
    if log_file:
        print(f"  full log     {log_file}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130 if interrupted else 1)


def run_spec(spec, verbose: bool = False, rerun_of: str | None = None, force: bool = False) -> int:
    stack_mode(), stack_idle_minutes(), reuse_mode()  # a setting gpuflow cannot use is refused before anything starts
    interrupt_on_sigterm()
    started = time.time()
    check_entrypoints(spec)  # the loop's import takes seconds: it starts first, in a process of its own
    api = temporary_api_launched()  # so does Prefect's API, when there is no server
    log_file = None
    if not verbose:
        from gpuflow.cluster.config import state_dir
        from gpuflow.flows.cli.console import quiet_console

        log_file = quiet_console(state_dir() / "logs", spec.sweep.metric if spec.sweep else None)
    warm_cluster, lost_api, interrupted = None, None, False
    try:
        from gpuflow.flows.experiment import run_experiment  # its imports take a second or two: meanwhile, the check

        import_in_background(*flow_imports(spec))  # this process now waits on the check, and on Prefect's API
        validate_spec(spec)  # before anything starts
        warm_cluster = prewarm_cluster(spec)
        if api:
            api.ready()
        try:
            state = run_experiment(spec, rerun_of=rerun_of, force=force, return_state=True)
        except Exception as exc:
            if prefect_api_answers():
                raise
            state, lost_api, interrupted = None, f"{type(exc).__name__}: {exc}", stopped(exc)
    except KeyboardInterrupt:
        state, interrupted = None, True
    finally:
        end_live_line()  # what follows, the summary or what went wrong, takes its place
        if warm_cluster:  # not adopted if the flow never reached provisioning: ours to remove
            from gpuflow.cluster.backends.local import LocalBackend

            LocalBackend().down(warm_cluster)
    if lost_api or (interrupted and not prefect_api_answers(timeout_s=1)):  # else Prefect's workers retry it at exit
        exit_without_prefect(spec, lost_api or "stopped by a signal or Ctrl-C", log_file, interrupted)
    if interrupted:
        print(
            f"\ngpuflow: {spec.name} interrupted; its cluster was torn down and its MLflow run marked KILLED",
            file=sys.stderr,
        )
        return 130
    if not state.is_completed() and not prefect_api_answers():
        exit_without_prefect(spec, f"{state.name}: {state.message or ''}", log_file)
    stack_left = api is not None and leave_a_stack(spec)  # this run started Prefect's API itself: the next need not
    if not state.is_completed():
        print(f"\ngpuflow: {spec.name} ended {state.name}: {state.message or ''}", file=sys.stderr)
        if log_file:
            print(f"  full log     {log_file}", file=sys.stderr)
        if stack_left:
            print(stack_left, file=sys.stderr)
        return 1
    print_summary(spec, state.result(), time.time() - started, log_file)
    if stack_left:
        print(stack_left)
    return 0


def tracking_uris(given: str | None):
    """Where to look for the run to rerun: the store given, else this machine's, then the servers Prefect knows."""
    from gpuflow.cluster.config import default_tracking_uri

    if given:
        yield given
        return
    yield default_tracking_uri()
    from gpuflow.flows.reconcile.sources import tracking_uris_or_local

    yield from (uri for uri in tracking_uris_or_local() if uri != default_tracking_uri())


def rerun(args: argparse.Namespace) -> int:
    """`gpuflow rerun RUN`: every check first (cluster/rerun/plan.py), then the run as `gpuflow run` runs it, then the
    two runs compared."""
    from gpuflow.cluster.config import state_dir
    from gpuflow.cluster.rerun import RerunRefused
    from gpuflow.cluster.rerun.plan import Ask, describe, prepare
    from gpuflow.flows.run_tags import source_stamp_of

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # spec.yaml, the diff: no bars on stderr
    ask = Ask(
        args.run,
        tracking_uris(args.tracking_uri),
        tuple(args.overrides),
        args.on,
        args.allow_data_change,
        args.allow_unrecorded_changes,
        # the flow runs' records of their code are read where a run's Prefect API is up; a temporary API's store
        # is this machine's own, beside the user's own MLflow store: the rerun then says its code is not verified
        stamp_of=source_stamp_of if prefect_api_up() else None,
    )
    try:
        planned = prepare(ask, Path.cwd(), state_dir() / "reruns")
    except RerunRefused as exc:
        print(f"gpuflow rerun: {exc}", file=sys.stderr)
        return 2
    print("\n".join(describe(planned)))
    if args.dry_run:
        print("gpuflow rerun: --dry-run: nothing launched")
        return 0
    code = run_spec(planned.spec, args.verbose, rerun_of=planned.found.run_id)
    print_comparison(planned)
    return code


def print_comparison(planned) -> None:
    from mlflow import MlflowClient

    from gpuflow.cluster.rerun.links import comparison, latest_rerun

    client = MlflowClient(planned.spec.tracking_uri)
    new_run_id = latest_rerun(client, planned.spec.experiment_name, planned.found.run_id)
    if new_run_id:
        print(f"\n  rerun of     {planned.found.run_id} -> {new_run_id}")
        print("\n".join("  " + line for line in comparison(planned.found.run, client.get_run(new_run_id))))
