"""What an agent episode's model requests recorded, and the training samples made of them (grpo.pipeline.agents).

Each request an agent sends to the run's OpenAI-compatible endpoint (grpo.pipeline.agent_endpoint) is recorded as a
`ModelCall`: the exact prompt token ids the server sampled from, the sampled token ids with their log-probs, and the
server's weight versions. `episode_samples` turns an episode's calls, in the order they were made, into samples:

- the first call starts a sample: its prompt (masked out of the loss), then its completion (trained);
- a later call whose prompt ids begin with an open sample's tokens extends that sample: the prompt's new tokens (a
  tool's result, the next user message, the template's turn markers) masked, then the completion trained;
- a call whose prompt does not extend any open sample (a template that drops earlier `<think>` blocks, a truncated or
  edited history, a request sent beside another one) is a prefix break: it starts a sample of its own.

So every trained token is one the server sampled, in the exact context it was sampled in, and no sample holds a token
the model did not see or produce where the sample says it did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from grpo.trainer.train_batch import IGNORE_INDEX


@dataclass(frozen=True)
class ModelCall:
    """One request of an episode as the server served it."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    # The sampler's log-prob of each completion token (None when rollouts carry none: data.rollout_logprobs=false).
    logprobs: Optional[tuple[float, ...]]
    finish_reason: Optional[str]
    # The server's weight versions when the request was admitted and when it finished.
    weight_version: int
    last_weight_version: int
    # "chat" (/v1/chat/completions) or "completion" (/v1/completions).
    kind: str = "chat"


@dataclass
class AgentSample:
    """One training sequence of an episode: `tokens`, `masks` (IGNORE_INDEX where the model did not sample the token,
    the token id where it did), `logprobs` (the sampler's at sampled positions, 1.0 elsewhere; None without them) and
    the indices of the calls it holds, in order."""

    tokens: list[int]
    masks: list[int]
    logprobs: Optional[list[float]]
    calls: list[int] = field(default_factory=list)
    truncated: bool = False

    @classmethod
    def start(cls, index: int, call: ModelCall) -> "AgentSample":
        n = len(call.prompt_ids)
        sample = cls(list(call.prompt_ids), [IGNORE_INDEX] * n, None if call.logprobs is None else [1.0] * n)
        sample.add_completion(index, call)
        return sample

    def extends(self, call: ModelCall) -> bool:
        """Whether `call`'s prompt begins with every token of this sample."""
        n = len(self.tokens)
        return len(call.prompt_ids) >= n and tuple(call.prompt_ids[:n]) == tuple(self.tokens)

    def extend(self, index: int, call: ModelCall) -> None:
        """Append what `call`'s prompt adds to this sample (masked), then its completion."""
        new = list(call.prompt_ids[len(self.tokens):])
        self.tokens += new
        self.masks += [IGNORE_INDEX] * len(new)
        if self.logprobs is not None:
            self.logprobs += [1.0] * len(new)
        self.add_completion(index, call)

    def add_completion(self, index: int, call: ModelCall) -> None:
        ids = list(call.completion_ids)
        self.tokens += ids
        self.masks += ids
        if self.logprobs is not None:
            if call.logprobs is None or len(call.logprobs) != len(ids):
                raise RuntimeError(f"call {index} has {0 if call.logprobs is None else len(call.logprobs)} log-probs "
                                   f"for {len(ids)} sampled tokens")
            self.logprobs += list(call.logprobs)
        self.calls.append(index)
        self.truncated = call.finish_reason == "length"


@dataclass
class EpisodeSamples:
    """An episode's samples and how many prefix breaks started one (every sample after the first)."""

    samples: list[AgentSample]

    @property
    def breaks(self) -> int:
        return max(0, len(self.samples) - 1)


def episode_samples(calls: list[ModelCall]) -> EpisodeSamples:
    """The samples of an episode's `calls` (in the order they were made): each call extends the longest sample its
    prompt begins with, else starts a new one (a prefix break)."""
    samples: list[AgentSample] = []
    for i, call in enumerate(calls):
        extendable = [s for s in samples if s.extends(call)]
        if extendable:
            max(extendable, key=lambda s: len(s.tokens)).extend(i, call)
        else:
            samples.append(AgentSample.start(i, call))
    return EpisodeSamples(samples)
