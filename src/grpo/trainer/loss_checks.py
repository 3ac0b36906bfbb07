"""The loss's own start-up checks (`GRPOLoss.check_config`): its settings against what the run feeds it, said before
anything is built. What it asks of the other components it reads from the capabilities they declare (a data source's
`reports_truncation`, `asynchronous_source`: `CheckContext.classes`), never from their class."""

from __future__ import annotations

import logging
from typing import Any

from grpo.config_values import CheckContext, ConfigError, option
from grpo.schema import LocalDataConfig, SharedMemorySyncConfig

log = logging.getLogger(__name__)


def check_loss_config(cfg: Any, ctx: CheckContext) -> None:
    """Each check of the `loss` node against the run (`cfg`: the whole run config), in the order a user should meet
    them: what the data source cannot give, a setting that would be ignored, then the off-policy corrections."""
    check_truncation_options_have_what_they_read(cfg, ctx)
    check_clip_can_act(cfg, ctx)
    check_stale_rollouts_keep_their_logprobs(cfg)
    check_rollout_logprobs(cfg)
    check_off_policy_masks(cfg)
    check_quantized_rollouts_corrected(cfg)


def off_policy_masks(loss: Any) -> list[str]:
    """The off-policy masks a loss config sets (`loss.token_mask=[..]`, ...)."""
    return [f"loss.{k}={list(loss[k])}" for k in ("token_mask", "sequence_mask") if loss.get(k) is not None]


def check_truncation_options_have_what_they_read(cfg: Any, ctx: CheckContext) -> None:
    """`loss.mask_truncated` needs rollouts that say which completions hit the token limit, `loss.overlong_buffer`
    also the limit they ran under (grpo.algorithms.overlong): refused at start-up for a data source that reports
    neither (data=atropos) or no single limit (multi-turn episodes), instead of at its first batch."""
    source_class = ctx.classes.get("data")
    if source_class is None:
        return
    name = cfg.data._target_.rsplit(".", 1)[-1]
    if cfg.loss.mask_truncated and not source_class.reports_truncation:
        raise ConfigError(f"loss.mask_truncated=true: the data source {name} does not report which completions hit "
                          "the token limit (only the built-in rollouts do); set loss.mask_truncated=false")
    if cfg.loss.overlong_buffer is not None and not source_class.reports_completion_limit:
        raise ConfigError(f"loss.overlong_buffer={cfg.loss.overlong_buffer}: the data source {name} reports no "
                          "single completion-token limit (single-turn built-in rollouts do); set "
                          "loss.overlong_buffer=null")


def check_clip_can_act(cfg: Any, ctx: CheckContext) -> None:
    """`loss.clip_eps` / `loss.clip_eps_high` on the command line of a run where the policy never moves between
    sampling and update (one optimizer step per rollout batch, synchronous, synced every batch, local data). Where the
    ratio the clip sees is then exactly 1 (pi_old recomputed, the proximal ratio of `loss.tis_cap`, or no rollout
    log-probs) the setting would be silently ignored: refused. With the default pi_old (vLLM's log-probs) the ratio is
    trainer/sampler and the clip acts only on their numerical mismatch (`grpo/logprob_diff`: ~1e-3 in float32, a few
    percent in bf16): warned. Not in a sweep, whose settings are common to its jobs
    (`-m train.ppo_epochs=1,2 loss.clip_eps=0.1,0.2`)."""
    given = ctx.given("loss.clip_eps", "loss.clip_eps_high")
    source_class = ctx.classes.get("data")
    if not given or ctx.multirun or source_class is None:
        return
    train, loss = cfg.train, cfg.loss
    moves = (train.ppo_epochs * train.mini_batches > 1 or train.max_staleness > 0
             or int(cfg.mode.sync_every) > 1 or source_class.asynchronous_source)
    if moves:
        return
    why = (f"{' '.join(given)}: each rollout batch gets one optimizer step, at the weights that sampled it "
           "(train.ppo_epochs x train.mini_batches = 1, train.max_staleness=0, mode.sync_every=1), so the policy does "
           "not move before its update (docs/algorithms.md, 'Several updates per rollout batch')")
    act = ("for the clip to act add e.g. train.ppo_epochs=2 train.mini_batches=2 (or train.max_staleness=1), else "
           "drop it")
    rollout_logprobs = cfg.data.get("rollout_logprobs", LocalDataConfig.rollout_logprobs)
    exact = (rollout_logprobs is False or loss.old_logprobs == "recompute"
             or loss.tis_cap is not None)
    if exact:
        raise ConfigError(f"{why}; the ratio the clip sees is exactly 1 here, so it never binds; {act}")
    log.warning("%s; the clip sees only the trainer/vLLM numerical mismatch (grpo/logprob_diff) and rarely binds; %s",
                why, act)


def check_stale_rollouts_keep_their_logprobs(cfg: Any) -> None:
    """Asynchronous rollouts (`train.max_staleness >= 1`) train on groups sampled by older weights: the ratio must
    see the rollout log-probs (pi_old = vLLM's, or the truncated importance weight of `loss.tis_cap`)."""
    k, loss = cfg.train.max_staleness, cfg.loss
    if k > 0 and loss.old_logprobs == "recompute" and loss.tis_cap is None:
        raise ConfigError(
            f"train.max_staleness={k} trains on groups sampled up to {k} syncs ago; loss.old_logprobs=recompute "
            "without loss.tis_cap would take pi_old from the current weights and ignore that gap. Use "
            "loss.old_logprobs=rollout (the default: the ratio is against vLLM's log-probs) or set loss.tis_cap."
        )


def check_rollout_logprobs(cfg: Any) -> None:
    """`data.rollout_logprobs=false` trains every rollout as on-policy (pi_old = the trainer's own log-probs): exact
    only when a batch gets one update from the weights that sampled it. Each setting that trains off that policy, or
    reads the sampler's log-probs, would otherwise be silently wrong: the ratio is 1 and the clip never acts."""
    if cfg.data.get("rollout_logprobs", LocalDataConfig.rollout_logprobs) is not False:
        return
    loss, train, masks = cfg.loss, cfg.train, off_policy_masks(cfg.loss)
    updates = train.ppo_epochs * train.mini_batches
    needs = [
        (loss.tis_cap is not None, f"loss.tis_cap={loss.tis_cap} weights tokens by pi_old / vLLM's "
         "sampling probability", "leave loss.tis_cap null"),
        (train.max_staleness > 0, f"train.max_staleness={train.max_staleness} trains on batches sampled by older "
         "weights", "use train.max_staleness=0"),
        (cfg.mode.sync_every > 1, f"mode.sync_every={cfg.mode.sync_every} samples "
         "batches with weights up to that many updates old", "use mode.sync_every=1"),
        (updates > 1 and loss.old_logprobs == "rollout", f"{updates} updates per batch "
         "(train.ppo_epochs x train.mini_batches) take pi_old from the rollout", "set loss.old_logprobs=recompute"),
        (float(loss.kl_coef) > 0, f"loss.kl_coef={loss.kl_coef} penalises the distance to the "
         "rollout policy", "set loss.kl_coef=0"),
        (bool(option(cfg.mode, "in_flight_updates", SharedMemorySyncConfig.in_flight_updates)),
         "mode.in_flight_updates=true samples rollouts from a "
         "mix of weights", "set mode.in_flight_updates=false"),
        (masks != [], f"{' and '.join(masks)} mask tokens by pi_old / vLLM's sampling probability",
         "leave them null"),
    ]
    for wrong, what, fix in needs:
        if wrong:
            raise ConfigError(
                f"data.rollout_logprobs=false trains each rollout as on-policy, but {what}, which needs vLLM's "
                f"log-probs: {fix}, or keep data.rollout_logprobs=true"
            )


def check_off_policy_masks(cfg: Any) -> None:
    """The masks compare vLLM's log-probs with pi_old; with several updates per batch and pi_old taken from the
    current weights (`loss.old_logprobs=rollout`) they would also mask the batch's own updates' movement."""
    train, masks = cfg.train, off_policy_masks(cfg.loss)
    updates = train.ppo_epochs * train.mini_batches
    if masks and updates > 1 and cfg.loss.old_logprobs == "rollout":
        raise ConfigError(
            f"{' and '.join(masks)} with {updates} updates per batch (train.ppo_epochs x train.mini_batches) and "
            "loss.old_logprobs=rollout would compare vLLM's log-probs with weights the batch's updates already moved, "
            "masking the policy's own movement; set loss.old_logprobs=recompute (pi_old: the trainer's log-probs "
            "before the batch's first update)"
        )


def check_quantized_rollouts_corrected(cfg: Any) -> None:
    """`server.quantization=fp8` samples rollouts from another policy than the trainer's (vLLM quantizes the served
    weights; whether the server can: grpo.serving.checks.check_quantization): the loss must correct that gap with
    an off-policy correction reading vLLM's log-probs (truncated importance sampling or a mask)."""
    quantization, loss = cfg.server.get("quantization"), cfg.loss
    if quantization is not None and loss.tis_cap is None and not off_policy_masks(loss):
        raise ConfigError(
            f"server.quantization={quantization} samples rollouts from FP8 weights while the trainer computes with its "
            "own, an off-policy gap no setting of this run corrects: set loss.old_logprobs=recompute with "
            "loss.tis_cap=2.0 (truncated importance sampling against vLLM's log-probs), or an off-policy mask "
            "(loss.token_mask=[0.5,2.0] or loss.sequence_mask=[...])")
