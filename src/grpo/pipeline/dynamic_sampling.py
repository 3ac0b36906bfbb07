"""DAPO's dynamic sampling: keep only the groups whose rewards differ, and generate more prompts to refill the batch.

A group whose samples all scored alike has advantage 0 at every token under every group baseline (GRPO, Dr. GRPO,
RLOO): it costs a forward and backward and teaches nothing, and the batch it sits in has fewer informative samples
than its size says. With ``data.dynamic_sampling=true`` the local pipeline drops such groups and generates further
rounds of fresh prompts until the rollout batch has as many informative groups as prompts it asked for
(``data.prompts_per_step``), at most ``data.max_refill_rounds`` extra rounds; a batch still short then trains on the
informative groups it has (fewer; counted). Each round draws its own prompts from (seed, batch, round), so a resumed
run regenerates the same batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from grpo.pipeline.group import Group

# generate(round, prompts) -> that round's groups: round 0 is the batch's own prompts, later rounds fresh ones.
GenerateRound = Callable[[int, int], list[Group]]


def informative(group: Group) -> bool:
    """True when the group's rewards are not all equal (its advantages from a group baseline are not all 0)."""
    return len(group.scores) > 1 and max(group.scores) > min(group.scores)


@dataclass(frozen=True)
class Refill:
    """What one rollout batch's dynamic sampling did: the groups to train and its counts."""

    groups: list[Group]
    # Extra generation rounds run after the first (0: the first round had enough informative groups).
    rounds: int
    generated: int
    dropped: int
    # Informative groups missing when the bound stopped the refill.
    short: int

    def metrics(self) -> dict[str, float]:
        """``data/refill_rounds``, ``data/groups_generated_per_kept`` (NaN when none was kept),
        ``data/zero_variance_groups_dropped``, ``data/refill_short_groups``."""
        kept = len(self.groups)
        return {
            "data/refill_rounds": float(self.rounds),
            "data/groups_generated_per_kept": self.generated / kept if kept else math.nan,
            "data/zero_variance_groups_dropped": float(self.dropped),
            "data/refill_short_groups": float(self.short),
        }


def refill(generate: GenerateRound, target: int, max_rounds: int) -> Refill:
    """Informative groups from ``generate`` until there are ``target`` of them or ``max_rounds`` extra rounds ran.

    Round 0 asks for ``target`` prompts; a refill round for the missing groups divided by the share of informative
    groups so far (over-generating by the observed rate, at most ``target`` prompts; ``target`` while none was
    informative). The first ``target`` informative groups, in generation order, are kept."""
    if target < 1 or max_rounds < 0:
        raise ValueError(f"dynamic sampling needs target >= 1 and max_refill_rounds >= 0, got {target}, {max_rounds}")
    kept: list[Group] = []
    generated = dropped = rounds = 0
    prompts = target
    while True:
        groups = generate(rounds, prompts)
        generated += len(groups)
        for group in groups:
            if informative(group):
                kept.append(group)
            else:
                dropped += 1
        missing = target - len(kept)
        if missing <= 0 or rounds >= max_rounds:
            break
        rounds += 1
        rate = len(kept) / generated if generated else 0.0
        prompts = target if rate == 0 else min(target, math.ceil(missing / rate))
    return Refill(kept[:target], rounds, generated, dropped, max(missing, 0))
