"""The infra a spec's options name, checked against what SkyPilot reads, before anything launches: a Slurm option's
cluster and partition must exist (SkyPilot asks the cluster; at launch it would only say so in a bare ValueError),
a Kubernetes option's context must be one of the kubeconfig's ($KUBECONFIG, else ~/.kube/config; read from the file
alone, no cluster is contacted)."""

from __future__ import annotations

from gpuflow.cluster.backends.skypilot.options import options_of, place_of
from gpuflow.cluster.spec.loading import SpecError
from gpuflow.cluster.spec.model import ExperimentSpec
from gpuflow.cluster.spec.options import Option


def check_infra(spec: ExperimentSpec) -> ExperimentSpec:
    problems = infra_problems(spec)
    if problems:
        raise SpecError(problems)
    return spec


def infra_problems(spec: ExperimentSpec) -> list[str]:
    """'field: problem and fix' for each option whose infra this machine cannot launch on."""
    if spec.compute.backend != "skypilot":
        return []
    places = {option: place_of(option)[0] for option in options_of(spec)}
    slurm = [option for option, cloud in places.items() if cloud == "slurm"]
    kubernetes = [option for option, cloud in places.items() if cloud == "kubernetes"]
    if slurm or kubernetes:
        # SkyPilot whole first: `gpuflow run` imports it in the background, and a submodule imported beside that
        # import can meet its parent half made (Python's deadlock breaking hands one thread a partial module)
        import sky  # noqa: F401
    return slurm_problems(slurm) + kubernetes_problems(kubernetes)


def slurm_problems(options: list[Option]) -> list[str]:
    from sky.clouds import Slurm

    problems = []
    for option in options:
        _, cluster, partition = place_of(option)
        try:
            Slurm().validate_region_zone(cluster, partition)
        except ValueError as error:
            problems.append(
                f"{where_field(option)}: {option.infra or option.region!r}: {error}; name a cluster of "
                "SkyPilot's Slurm config and one of its partitions (or none, for its default)"
            )
    return problems


def kubernetes_problems(options: list[Option]) -> list[str]:
    if not options:
        return []
    from sky.provision.kubernetes import utils

    contexts = utils.get_all_kube_context_names()
    where = ", ".join(utils.get_kubeconfig_paths())
    problems = []
    for option in options:
        context, value = place_of(option)[1], option.infra or option.region
        if context and context not in contexts:
            problems.append(
                f"{where_field(option)}: {value!r}: no context {context!r} in the kubeconfig ({where}); it has: "
                f"{', '.join(contexts) or 'none'}. Name one (e.g. k8s/{contexts[0] if contexts else '<context>'}), "
                "add the context to that file, or point KUBECONFIG at the file that has it"
            )
        elif not contexts:
            problems.append(
                f"{where_field(option)}: {value!r} needs a Kubernetes context and the kubeconfig ({where}) "
                "has none; add one, or point KUBECONFIG at a kubeconfig that has one"
            )
    return problems


def where_field(option: Option) -> str:
    return f"{option.field}.{'infra' if option.infra else 'region'}"
