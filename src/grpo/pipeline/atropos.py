"""data=atropos: training groups from an Atropos trainer API (`run-api` from atroposlib).

Talks plain HTTP with `requests` so the trainer never imports atroposlib. The server's contract (atroposlib 0.4.0,
`atroposlib/api/server.py`): the trainer POSTs /register first, then polls GET /batch, which answers
`{"batch": [group, ...]}` once `batch_size` sequences are queued and `{"batch": null}` until then. Every /batch that
hands out a batch advances the server's step (`GET /status` → `current_step`).

Staleness. Atropos is asynchronous by nature: environments generate while the trainer trains, so a group may come
from weights several syncs old. A group that carries its weight version (`weight_version`, in `generation_params`
where it survives run-api; grpo.tasks.atropos_env sends it, read from the inference server) has a lag: the
trainer's version when the batch arrives minus that version. Each batch reports `async/staleness_mean` /
`async/staleness_max` over its versioned groups and counts the unversioned ones (`async/unversioned_groups`: their
lag is unknown, so they are kept). With `train.max_staleness = k >= 1` a group with lag > k is dropped and counted
(`async/dropped_groups`, run total `async/dropped_groups_total`); k = 0 sets no limit. The trainer cannot make
environments wait (atroposlib's own `max_batches_offpolicy` throttles them), so only `train.stale_policy=drop`
applies.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import requests

from grpo.pipeline.base import DataPipeline, DataSourceError, PipelineContext
from grpo.pipeline.group import Group, MalformedGroup, parse_group
from grpo.schema.data import AtroposDataConfig

__all__ = ["AtroposError", "AtroposPipeline", "AtroposTimeoutError", "MalformedGroup", "validate_group"]

log = logging.getLogger(__name__)

# A wait for run-api's batch says so after this many seconds, then at doubling gaps up to WAIT_REPORT_MAX_S: without
# it the trainer was silent up to data.max_wait_s (10 minutes) while no environment pushed usable groups.
WAIT_REPORT_FIRST_S = 30.0
WAIT_REPORT_MAX_S = 120.0


class AtroposError(DataSourceError):
    """run-api could not be reached or answered something unusable; the message names the URL."""


class AtroposTimeoutError(AtroposError, TimeoutError):
    """No batch arrived within `max_wait_s`."""


def validate_group(raw: Any, vocab_size: Optional[int] = None) -> Group:
    """A group from run-api as a `Group`; raises MalformedGroup (naming the field) when it cannot be trained on,
    an empty group included (the pipeline drops and counts it instead of stopping the run in the batcher)."""
    group = parse_group(raw, vocab_size)
    if len(group) == 0:
        raise MalformedGroup("tokens", "empty: the group has no sequences")
    return group


class AtroposPipeline(DataPipeline):
    """Registers with run-api and turns its /batch answers into the groups of each optimizer step.

    Groups older than `ctx.max_staleness` weight versions are dropped (see the module docstring).

    Polling back-off: `poll_interval_s`, doubling on each empty answer up to 8x, reset when data arrives; an
    `AtroposTimeoutError` after `max_wait_s` without a batch. Each request gets `max_retries` retries with back-off on
    connection errors, 5xx answers and malformed JSON, then an `AtroposError` naming the URL. Structurally bad groups
    and groups with a sequence over `ctx.max_seq_len` are dropped and counted in `last_metrics`.
    """

    asynchronous_source = True

    def __init__(
        self,
        url: str = AtroposDataConfig.url,
        wandb_group: str = AtroposDataConfig.wandb_group,
        wandb_project: str = AtroposDataConfig.wandb_project,
        poll_interval_s: float = AtroposDataConfig.poll_interval_s,
        max_wait_s: float = AtroposDataConfig.max_wait_s,
        max_retries: int = AtroposDataConfig.max_retries,
        request_timeout_s: float = AtroposDataConfig.request_timeout_s,
    ) -> None:
        self.url = url.rstrip("/")
        self.wandb_group = wandb_group
        self.wandb_project = wandb_project
        self.poll_interval_s = max(float(poll_interval_s), 0.01)
        self.max_wait_s = float(max_wait_s)
        self.max_retries = int(max_retries)
        self.request_timeout_s = float(request_timeout_s)
        self.ctx: Optional[PipelineContext] = None
        self.session: Optional[requests.Session] = None
        self.step: Optional[int] = None
        self.uuid: Optional[int] = None
        self.vocab_size: Optional[int] = None
        self._retries = 0
        # 5xx answers to GET /batch in the current fetch: run-api 0.4.0 forms a batch, advances its step, then fails
        # to send it (a NaN or inf an environment pushed is not JSON), so the batch is gone.
        self._batch_errors = 0
        self.last_metrics: dict[str, float] = {}
        # Run totals of dropped groups, for the end-of-run summary.
        self.totals: dict[str, int] = {"data/dropped_malformed": 0, "data/dropped_too_long": 0,
                                       "async/dropped_groups": 0}

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, path: str, payload: Optional[dict] = None) -> Any:
        """One JSON request with bounded retries; returns the decoded JSON."""
        assert self.session is not None, "AtroposPipeline.setup() was not called"
        url = f"{self.url}{path}"
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._retries += 1
                time.sleep(min(self.poll_interval_s * 2 ** (attempt - 1), 8 * self.poll_interval_s))
            try:
                resp = self.session.request(method, url, json=payload, timeout=self.request_timeout_s)
            except requests.RequestException as e:
                last_error = f"{type(e).__name__}: {e}"
                continue
            if resp.status_code >= 500:
                last_error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                if path == "/batch":
                    self._batch_errors += 1
                    log.warning("run-api %s answered %s; the batch it was sending is likely lost (run-api 0.4.0 "
                                "answers 500 when a group holds a NaN or inf, e.g. a score, and drops the batch; its "
                                "log says more). Counted in data/batch_server_errors; asking again", url, last_error)
                continue
            if resp.status_code >= 400:
                # A client error will not fix itself by retrying: the request or the server version is wrong.
                raise AtroposError(f"run-api {method} {url} answered HTTP {resp.status_code}: {resp.text[:500]}")
            try:
                return resp.json()
            except ValueError:
                last_error = f"malformed JSON: {resp.text[:200]!r}"
                continue
        raise AtroposError(
            f"run-api {method} {url} failed after {self.max_retries + 1} attempts ({last_error}); "
            f"is `run-api` running and reachable at {self.url}?"
        )

    def _register(self, starting_step: Optional[int] = None) -> None:
        """POST /register; `starting_step`: run-api's step to start from (default the run's first step; a trainer
        registering again with a restarted run-api passes the step it is at, so environments see no step regress)."""
        ctx = self.ctx
        assert ctx is not None
        body = {
            "wandb_group": self.wandb_group,
            "wandb_project": self.wandb_project,
            "batch_size": int(ctx.batch_size),
            "max_token_len": int(ctx.max_seq_len),
            "checkpoint_dir": str(ctx.run_dir / "checkpoints"),
            "save_checkpoint_interval": int(ctx.checkpoint_every),
            "starting_step": int(ctx.start_step if starting_step is None else starting_step),
            "num_steps": int(ctx.total_steps),
        }
        answer = self._request("POST", "/register", body)
        self.uuid = answer.get("uuid") if isinstance(answer, dict) else None
        info = self._request("GET", "/info")
        server_batch = info.get("batch_size") if isinstance(info, dict) else None
        if server_batch == -1:
            # atroposlib 0.4.0 only initialises trainer state on /register when no data has been queued yet.
            raise AtroposError(
                f"run-api at {self.url} accepted /register but did not initialise the trainer state: an environment "
                "pushed data before the trainer registered. Restart run-api and start the trainer before environments."
            )
        if server_batch != ctx.batch_size:
            # /register keeps the first trainer's settings; batches would not match this run's step size.
            raise AtroposError(
                f"run-api at {self.url} serves batches of {server_batch} sequences, but this run needs "
                f"{ctx.batch_size} (micro_batch_size x grad_accum): another trainer registered first. Restart run-api."
            )

    # ------------------------------------------------------------------ DataPipeline
    def preflight(self) -> None:
        """run-api answers GET /status (with the bounded retries of every request), before the trainer starts its
        inference server: Atropos' start order is run-api first, then the trainer, then the environments."""
        self.session = self.session or requests.Session()
        try:
            self._request("GET", "/status")
        except AtroposError as e:
            raise AtroposError(
                f"{e} Start Atropos' run-api first (`run-api`, or `python -m grpo.stack` for run-api, the inference "
                "server, an environment and this trainer in one command), or point data.url at it"
            ) from None

    def setup(self, ctx: PipelineContext) -> None:
        """POST /register before anything else (run-api's registration-order quirk, see _register)."""
        self.ctx = ctx
        self.session = self.session or requests.Session()  # the one preflight opened, if it ran
        self._retries = 0
        # Ids at or past the tokenizer's size decode to nothing and may be past the model's embedding rows.
        sizes = [len(ctx.tokenizer) if ctx.tokenizer is not None else None,
                 ctx.batch_shape.vocab_size if ctx.batch_shape is not None else None]
        self.vocab_size = min((v for v in sizes if v), default=None)
        self._register()
        log.info("registered with run-api at %s (uuid %s, batch %d sequences)", self.url, self.uuid, ctx.batch_size)

    def _filter(self, batch: list, counts: dict[str, int], current: int) -> list[Group]:
        """The groups of one /batch answer that can be trained on now (`current`: the trainer's weight version)."""
        assert self.ctx is not None
        limit, stale = self.ctx.max_staleness, 0
        kept = []
        for i, raw in enumerate(batch):
            try:
                group = validate_group(raw, self.vocab_size)
            except MalformedGroup as e:
                counts["data/dropped_malformed"] += 1
                log.warning("dropping malformed group %d from %s: %s", i, self.url, e)
                continue
            longest = max(len(seq) for seq in group.tokens)
            if longest > self.ctx.max_seq_len:
                counts["data/dropped_too_long"] += 1
                log.warning("dropping group %d: a sequence of %d tokens > max_seq_len %d", i, longest,
                            self.ctx.max_seq_len)
                continue
            if limit and group.weight_version is not None and current - group.weight_version > limit:
                stale += 1
                continue
            kept.append(group)
        if stale:
            counts["async/dropped_groups"] += stale
            log.warning("dropping %d of %d groups older than train.max_staleness=%d versions (trainer at version %d)",
                        stale, len(batch), limit, current)
        return kept

    def _why_no_batch(self) -> str:
        """The likely cause of a wait for a batch that timed out, from run-api's queue (GET /status)."""
        assert self.ctx is not None
        try:
            status = self._request("GET", "/status")
        except AtroposError:
            status = None
        queued = status.get("queue_size") if isinstance(status, dict) else None
        if isinstance(queued, int) and queued > 0:
            # run-api hands out whole groups adding up to exactly the batch: groups whose sizes do not divide it
            # (or one larger than it) wait in its queue forever while the environment keeps pushing.
            return (f"run-api holds {queued} queued groups that make no batch of exactly {self.ctx.batch_size} "
                    f"sequences: it hands out whole groups only, so every group's size (the environments' group_size) "
                    f"must divide {self.ctx.batch_size} (train.micro_batch_size x train.grad_accum)")
        return "is an environment running and pushing /scored_data?"

    @staticmethod
    def _lag_metrics(groups: list[Group], current: int) -> dict[str, float]:
        """Lag (trainer's version - the group's) of the versioned groups; unversioned ones are only counted."""
        lags = [current - g.weight_version for g in groups if g.weight_version is not None]
        mid_sync = sum(g.last_weight_version is not None and g.weight_version is not None
                       and g.last_weight_version != g.weight_version for g in groups)
        out = {"async/unversioned_groups": float(len(groups) - len(lags)), "async/mid_sync_groups": float(mid_sync)}
        if lags:
            out.update({"async/staleness_mean": sum(lags) / len(lags), "async/staleness_max": float(max(lags))})
        return out

    def next_groups(self, step: int) -> list[Group]:
        """Poll /batch until a batch with at least one valid group arrives, or raise after max_wait_s."""
        start = time.monotonic()
        self._retries = self._batch_errors = 0
        counts = {"data/dropped_malformed": 0, "data/dropped_too_long": 0, "async/dropped_groups": 0}
        interval, polls, reregistered = self.poll_interval_s, 0, False
        gap = WAIT_REPORT_FIRST_S
        next_report = start + gap
        while True:
            answer = self._request("GET", "/batch")
            polls += 1
            if not isinstance(answer, dict):
                raise AtroposError(f"run-api {self.url}/batch answered a {type(answer).__name__}, not an object")
            if answer.get("status") == "error":
                # The server lost our registration (restarted): register again once, then give up clearly.
                if reregistered:
                    raise AtroposError(f"run-api {self.url}/batch keeps answering: {answer.get('message')}")
                log.warning("run-api at %s says %r (restarted? the groups it had queued are gone); registering again "
                            "at step %d (counted in data/reregistrations)", self.url, answer.get("message"), step)
                self._register(starting_step=step)
                reregistered = True
                continue
            batch = answer.get("batch")
            if batch is not None and not isinstance(batch, list):
                raise AtroposError(f"run-api {self.url}/batch: 'batch' is a {type(batch).__name__}, not a list")
            if batch:
                current = self.ctx.generation.version()
                groups = self._filter(batch, counts, current)
                if groups:
                    break
            waited = time.monotonic() - start
            if waited >= self.max_wait_s:
                dropped = sum(counts.values())
                raise AtroposTimeoutError(
                    f"no usable batch from run-api at {self.url} after {waited:.0f}s (max_wait_s={self.max_wait_s:g}, "
                    f"{dropped} bad or stale groups dropped, {self._batch_errors} batches lost to run-api errors); "
                    f"{self._why_no_batch()}"
                )
            if batch:
                # Every group of this batch was bad or stale; the server has moved on a step. Ask again at once.
                interval = self.poll_interval_s
                continue
            if time.monotonic() >= next_report:
                log.info("waiting for a batch from run-api at %s: %.0f s of data.max_wait_s=%g; %s", self.url, waited,
                         self.max_wait_s, self._why_no_batch())
                gap = min(2 * gap, WAIT_REPORT_MAX_S)
                next_report += gap
            time.sleep(min(interval, max(self.max_wait_s - waited, 0.0)))
            interval = min(interval * 2, 8 * self.poll_interval_s)
        self.step = step
        self._record_fetch(counts, groups, current, time.monotonic() - start, polls, reregistered)
        return groups

    def _record_fetch(self, counts: dict[str, int], groups: list[Group], current: int, waited: float, polls: int,
                      reregistered: bool) -> None:
        """The fetch's `last_metrics` (and the run's totals of dropped groups)."""
        for k, v in counts.items():
            self.totals[k] += v
        self.last_metrics = {
            **{k: float(v) for k, v in counts.items()},
            **self._lag_metrics(groups, current),
            "async/dropped_groups_total": float(self.totals["async/dropped_groups"]),
            "data/groups": float(len(groups)),
            "data/wait_seconds": waited,
            "data/polls": float(polls),
            "data/retries": float(self._retries),
            "data/batch_server_errors": float(self._batch_errors),
            "data/reregistrations": float(reregistered),
        }

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
