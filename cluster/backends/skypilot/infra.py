"""The infra a spec's options name, checked against what SkyPilot reads on this machine, before anything launches:
a Kubernetes option's context must be one of the kubeconfig's ($KUBECONFIG, else ~/.kube/config). Read with
SkyPilot's own function, which only reads the file: no cluster is contacted."""

from __future__ import annotations

from gpuflow.cluster.backends.skypilot.options import options_of, place_of
from gpuflow.cluster.spec.loading import SpecError
from gpuflow.cluster.spec.model import ExperimentSpec


def check_infra(spec: ExperimentSpec) -> ExperimentSpec:
    problems = infra_problems(spec)
    if problems:
        raise SpecError(problems)
    return spec


def infra_problems(spec: ExperimentSpec) -> list[str]:
    """'field: problem and fix' for each option whose infra this machine cannot launch on."""
    if spec.compute.backend != "skypilot":
        return []
    kubernetes = [option for option in options_of(spec) if place_of(option)[0] == "kubernetes"]
    if not kubernetes:
        return []
    from sky.provision.kubernetes import utils

    contexts = utils.get_all_kube_context_names()
    where = ", ".join(utils.get_kubeconfig_paths())
    problems = []
    for option in kubernetes:
        context = place_of(option)[1]
        field = f"{option.field}.{'infra' if option.infra else 'region'}"
        value = option.infra or option.region
        if context and context not in contexts:
            problems.append(
                f"{field}: {value!r}: no context {context!r} in the kubeconfig ({where}); it has: "
                f"{', '.join(contexts) or 'none'}. Name one (e.g. k8s/{contexts[0] if contexts else '<context>'}), "
                "add the context to that file, or point KUBECONFIG at the file that has it")
        elif not contexts:
            problems.append(f"{field}: {value!r} needs a Kubernetes context and the kubeconfig ({where}) has none; "
                            "add one, or point KUBECONFIG at a kubeconfig that has one")
    return problems
