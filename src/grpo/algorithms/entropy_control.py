"""The entropy bonus's coefficient steered towards a target entropy (``loss.entropy_target``).

A constant bonus either does little or, once the policy gradient stops holding the entropy, makes it run away
(bench/README.md, "The entropy bonus on the skill task"). The adaptive rule, in the spirit of Skywork-OR1's adaptive
entropy control: after each optimizer step the coefficient rises by a fixed step while the step's entropy is below
the target and falls by it otherwise, within ``[0, max_coef]``, so the bonus acts only while the entropy is low.
"""

from __future__ import annotations


def adapt_entropy_coef(coef: float, entropy: float, target: float, delta: float, max_coef: float) -> float:
    """The next step's coefficient: ``coef + delta`` while ``entropy < target``, else ``coef - delta``, clamped to
    ``[0, max_coef]``."""
    moved = coef + delta if entropy < target else coef - delta
    return min(max(moved, 0.0), max_coef)
