"""An example plugin: `--external-plugins examples/plugins/my_algorithms.py --advantage-estimator mean_baseline`.

A plugin is a Python file that registers functions under new names; the name is
then a valid value of the matching flag.
"""

from megarl.algorithms import ADVANTAGE_ESTIMATORS, register, sequence_rewards_to_tokens


@register(ADVANTAGE_ESTIMATORS, "mean_baseline")
def mean_baseline(token_rewards, mask, group_size=None, **options):
    """Score minus the group mean (no std scaling), broadcast to every response token."""
    scores = (token_rewards * mask).sum(dim=-1)
    baseline = scores.view(-1, group_size).mean(dim=1, keepdim=True).expand(-1, group_size).reshape(-1)
    advantages = (scores - baseline)[:, None] * mask
    return advantages, advantages
