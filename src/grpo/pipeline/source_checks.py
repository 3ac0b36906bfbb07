"""The start-up checks every data source gets (`DataPipeline.check_config`), read from the capabilities its class
declares (`asynchronous_source`, `supports_async_rollouts`, `concurrent_batches`, `sequences_per_step`), never from
which class it is: a new source that declares a capability gets what it allows. Also the asynchronous producer's
queue bounds (grpo.pipeline.rollout_queue), which the start-up check and the producer share."""

from __future__ import annotations

import logging
from typing import Any, Optional

from grpo.config_values import CheckContext, ConfigError
from grpo.serving.server import replica_count

log = logging.getLogger(__name__)


def check_source_config(source: type, cfg: Any, ctx: CheckContext) -> None:
    """The checks of the run's `train` and `server` settings against the data source class `source`."""
    check_grad_accum_used(source, cfg, ctx)
    check_replicas_reach_the_data(source, cfg)
    check_async(source, cfg)


def queue_capacity(max_staleness: int, stale_policy: str, rollout_queue: Optional[int]) -> int:
    """Rollout batches the producer may have generated and not yet handed over (grpo.pipeline.rollout_queue's module
    docstring, the queue bound)."""
    if stale_policy == "wait":  # counted from the last batch the trainer finished (that docstring)
        return int(max_staleness) + 1
    return int(max_staleness) + 1 if rollout_queue is None else int(rollout_queue)


def check_batches_in_flight(batches_in_flight: int, capacity: int, inner: type) -> None:
    """`train.rollout_batches_in_flight` fits the queue bound and the inner pipeline (ValueError saying what to set)."""
    if batches_in_flight < 1:
        raise ValueError(f"train.rollout_batches_in_flight must be >= 1, got {batches_in_flight}")
    if batches_in_flight > capacity:
        raise ValueError(
            f"train.rollout_batches_in_flight={batches_in_flight} but at most {capacity} rollout batches may be "
            "generated ahead of the trainer (train.max_staleness + 1 with stale_policy=wait, train.rollout_queue with "
            "drop): the other threads would only wait; raise train.max_staleness or lower rollout_batches_in_flight")
    if batches_in_flight > 1 and not inner.concurrent_batches:
        raise ValueError(f"train.rollout_batches_in_flight={batches_in_flight} needs a data pipeline that generates "
                         f"several batches at once; {inner.__name__} does one at a time: set it to 1")


def check_grad_accum_used(source: type, cfg: Any, ctx: CheckContext) -> None:
    """`train.grad_accum` on the command line of a local-data run whose steps generate more sequences than
    micro_batch_size x grad_accum: the trainer trains every sequence the pipeline generates, in micro-batches of
    train.micro_batch_size, so the setting (the Atropos trainer's --gradient-accumulation-steps) would be silently
    ignored. Not in a sweep, whose settings are common to its jobs. A value from a config file (an experiment whose
    data.group_size was raised on the command line) is warned about instead: the run is what was asked for."""
    given = ctx.given("train.grad_accum")
    per_step = source.sequences_per_step(cfg.data)
    if ctx.multirun or per_step is None:
        return
    micro, accum = cfg.train.micro_batch_size, cfg.train.grad_accum
    if per_step <= micro * accum:
        return
    why = (f"each step trains all {per_step} sequences the data generates (data.prompts_per_step x data.group_size), "
           f"in micro-batches of train.micro_batch_size={micro} ({-(-per_step // micro)} of them), not {micro} x "
           f"{accum} = {micro * accum}")
    if not given:
        log.warning("train.grad_accum=%s (from the config) has no effect: %s", accum, why)
        return
    raise ConfigError(
        f"{given[0]} would be ignored: {why}; to train fewer sequences per step lower data.prompts_per_step or "
        "data.group_size, for smaller micro-batches lower train.micro_batch_size"
    )


def check_replicas_reach_the_data(source: type, cfg: Any) -> None:
    """Several replicas need a data source the trainer generates for (its requests are spread over them): a source
    that generates on its own (Atropos environments) samples from the one server URL it was given."""
    replicas = replica_count(cfg.server)
    if replicas > 1 and source.asynchronous_source:
        raise ConfigError(
            f"server.replicas={replicas} with data={source.__name__}: its environments sample from the one "
            "server URL they are given, so the other replicas would stay idle; use one replica (server.replicas=1) "
            "or a local data pipeline (data=local_*), whose requests the trainer spreads over the replicas"
        )


def check_async(source: type, cfg: Any) -> None:
    """Asynchronous rollouts (`train.max_staleness >= 1`): a pipeline the producer can run ahead
    (`supports_async_rollouts`) or a source that generates on its own (`asynchronous_source`, e.g. Atropos: k drops
    older groups), and a queue that holds a batch. (That the loss's ratio sees the rollout log-probs, as stale
    groups are off-policy, is the loss's check.)"""
    train = cfg.train
    k = train.max_staleness
    if k < 0:
        raise ConfigError(f"train.max_staleness must be >= 0 (0 = synchronous), got {k}")
    if k == 0:
        return
    if train.rollout_queue is not None and train.rollout_queue < 1:
        raise ConfigError(f"train.rollout_queue must be >= 1 or null, got {train.rollout_queue}")
    target = cfg.data._target_
    if source.asynchronous_source:
        check_asynchronous_source(cfg, target)
        return
    if not source.supports_async_rollouts:
        raise ConfigError(
            f"train.max_staleness={k} runs the local rollout pipeline in a producer thread; data={target} is neither "
            "one nor an asynchronous source like data=atropos. Use train.max_staleness=0 with it."
        )
    if train.rollout_batches_in_flight > 1:
        capacity = queue_capacity(k, str(train.stale_policy), train.rollout_queue)
        try:
            check_batches_in_flight(train.rollout_batches_in_flight, capacity, source)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check_asynchronous_source(cfg: Any, target: str) -> None:
    """k >= 1 with a source that generates on its own (Atropos) can only drop: the trainer cannot make its
    environments wait, and it has no queue of its own."""
    train = cfg.train
    if train.stale_policy != "drop":
        raise ConfigError(
            f"train.max_staleness={train.max_staleness} with data={target}: the environments generate on their own "
            "and the trainer cannot make them wait, so groups older than k versions can only be dropped; set "
            "train.stale_policy=drop (atroposlib's max_batches_offpolicy throttles environments on their side)"
        )
    if train.rollout_queue is not None:
        raise ConfigError(
            f"train.rollout_queue={train.rollout_queue} has no effect with data={target} (run-api holds the "
            "queue); leave it null"
        )
    if train.rollout_batches_in_flight != 1:
        raise ConfigError(
            f"train.rollout_batches_in_flight={train.rollout_batches_in_flight} has no effect with "
            f"data={target} (the environments generate on their own); leave it at 1"
        )
