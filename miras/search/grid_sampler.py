"""The grid sampler (`sampler: grid`): every configuration of a study's templates, each tried
once, in an order shuffled by the sampler's seed.

    grid_size(study.spec_space) * grid_size(study.train_space)   # the study's default trials
    grid_problems(study.train_space)                             # a float range: no grid

The configurations form a tree, not a product: a choice makes the sum of its options'
configurations (an option's own parameters exist only when it is picked), a mapping the product
of its fields', an int range one per value, and a fixed value or a sweep (run inside the trial)
one. Optuna's BruteForceSampler walks that tree, so a conditional parameter is not gridded
under the options that lack it; a float range has no list of values and is refused.
"""

from __future__ import annotations

import math
from typing import Any

from miras.errors import Problem
from miras.search.space import Choice, Group, Node, Range, distributions


def grid_size(node: Node) -> int:
    """How many configurations the template makes (1 for a template with no distribution)."""
    if isinstance(node, Group):
        return math.prod(grid_size(child) for child in node.fields.values())
    if isinstance(node, Choice):
        return sum(grid_size(option) for option in node.options)
    if isinstance(node, Range) and node.kind == "int":
        return (int(node.high) - int(node.low)) // int(node.step or 1) + 1
    return 1  # Fixed, Sweep, Broken (reported elsewhere), and a float range (refused below)


def grid_problems(node: Node) -> list[Problem]:
    """One problem per float range: a grid tries listed values, and a float range has none."""
    return [
        Problem(
            d.path,
            f"sampler grid tries every listed value, and a float range [{d.low}, {d.high}] lists "
            "none; write {choices: [...]} with the values to try, or use sampler tpe or random",
        )
        for d in distributions(node)
        if isinstance(d, Range) and d.kind == "float"
    ]


def grid_sampler(seed: int | None) -> Any:
    """Optuna's BruteForceSampler: it picks a configuration no finished, running or failed
    trial holds, and stops the study once every one is taken. (Optuna is imported here: a study
    is validated without it.)"""
    import optuna

    return optuna.samplers.BruteForceSampler(seed=seed)
