"""Checks that need the data, made before any process starts (`fedsim validate`, `fedsim run`,
`fedsim sweep`): a missing dataset used to surface only after Ray had started, leaving a run
folder with nothing in it.

The schema (fedsim/scenario.py) checks what the YAML alone decides; this checks what the files
decide: the dataset and the edge-case sets can be read, the partitioner can split the data as
asked, and the model takes the dataset's inputs and gives one output per class. It does the work
through the process's `Runtime` (fedsim/runtime.py), which caches it: the server that runs next
in this process loads nothing twice.
"""

from __future__ import annotations

import torch

from fedsim.data.base import DataFileError
from fedsim.scenario import ScenarioError


def preflight(scenario, source: str = "<scenario>") -> None:
    """Raise ScenarioError (field path, reason, value) if `scenario` cannot start with the files at hand."""
    from fedsim.runtime import runtime_for

    rt = runtime_for(scenario)
    problems = []
    try:
        data = rt.data
    except DataFileError as err:
        raise ScenarioError(source, [("data.dataset", str(err), scenario.data.dataset.name)]) from None
    try:
        rt.partitions
    except (ValueError, RuntimeError) as err:  # e.g. Dirichlet cannot give every client min_partition_size
        problems.append(("data.partition", f"cannot split {data.name} ({len(data.y_train)} examples) into "
                         f"{scenario.federation.num_clients} partitions: {err}", scenario.data.partition.name))
    problems += model_problems(rt, data)
    problems += server_data_problems(scenario, data)
    if scenario.attack is not None and rt.attack is not None:
        try:
            rt.attack.backdoor_test_set(rt)  # reads and builds the edge-case / trigger sets
        except (DataFileError, ValueError) as err:
            field = "attack.edge_set" if hasattr(scenario.attack, "edge_set") else "attack"
            problems.append((field, str(err), scenario.attack.name))
    problems += tracking_problems(scenario)
    problems += vectorize_problems(rt)
    problems += secure_aggregation_data_problems(rt)
    if problems:
        raise ScenarioError(source, problems)


def vectorize_problems(rt) -> list[tuple[str, str, object]]:
    """`federation.vectorize: on` for a model or protocol whose clients cannot train vectorised
    (auto would train them one by one, saying why)."""
    if rt.scenario.federation.vectorize != "on":
        return []
    from fedsim.client.cohort import cohort_refusal

    reason = cohort_refusal(rt)
    if reason is None:
        return []
    return [("federation.vectorize", f"honest clients cannot train vectorised here: {reason} (use auto or off)", "on")]


def secure_aggregation_data_problems(rt) -> list[tuple[str, str, object]]:
    """SecAgg+ quantises each client's weight as round(Q·w/W): a partition larger than an explicit
    `max_weight` W would overflow the weight's range (Flower only warns, on the client)."""
    sa = rt.scenario.secure_aggregation
    if sa is None or sa.max_weight is None:
        return []
    try:
        largest = int(rt.partitions.sizes.max())
    except (ValueError, RuntimeError):
        return []  # reported as data.partition
    if largest > sa.max_weight:
        return [("secure_aggregation.max_weight", f"the largest partition holds {largest} examples, more than "
                 f"max_weight={sa.max_weight:g}: its quantised weight would overflow; raise it or leave it unset "
                 "(the largest partition)", sa.max_weight)]
    return []


def tracking_problems(scenario) -> list[tuple[str, str, object]]:
    """A tracking sink whose library is missing, named before Ray starts (in the ServerApp it would
    surface only as a failed run)."""
    if not scenario.tracking:
        return []
    from fedsim.tracking.base import TrackingUnavailable
    from fedsim.tracking.trackers import require_libraries

    try:
        require_libraries(scenario)
    except TrackingUnavailable as err:
        return [("tracking", str(err), [s.name for s in scenario.tracking])]
    return []


def model_problems(rt, data) -> list[tuple[str, str, object]]:
    """The model applied to one input of the dataset: it must run and give one score per class."""
    name = rt.scenario.model.name
    try:
        model = rt.build_model(None)
        model.eval()
        with torch.no_grad():
            out = model(torch.from_numpy(data.x_test[:1].copy() if len(data.x_test) else data.x_train[:1].copy()))
    except (RuntimeError, ValueError) as err:
        return [("model", f"{name} cannot take {data.name}'s inputs of shape {list(data.input_shape)}: "
                 f"{str(err).splitlines()[0]}", name)]
    if tuple(out.shape) != (1, data.num_classes):
        return [("model", f"{name} gives {list(out.shape[1:])} outputs for {data.name}'s {data.num_classes} classes", name)]
    return []


def server_data_problems(scenario, data) -> list[tuple[str, str, object]]:
    """A rule that holds its own sample of the data (FLTrust's root dataset) needs that many examples."""
    spec = scenario.aggregator
    size, source = getattr(spec, "root_size", None), getattr(spec, "root_source", None)
    if size is None or source is None:
        return []
    pool = len(data.y_train) if source == "train" else len(data.y_test)
    if size > pool:
        return [("aggregator.root_size", f"{size} examples asked for, the {source} split of {data.name} has {pool}", size)]
    return []
