"""Agents written against the OpenAI API (grpo.pipeline.agents, agent_endpoint, agent_samples, chat_prompts,
tool_calls): the samples are the server's tokens and the template's, token for token; tool results carry no gradient;
a template that strips `<think>` makes one sample per prefix break, none with a token the model did not produce; the
endpoint refuses what it cannot serve exactly; experiment=agent_calculator_tiny trains."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, attach
from grpo.inference.client import Endpoint
from grpo.pipeline.agent_endpoint import call_seed
from grpo.pipeline.agent_samples import ModelCall, episode_samples
from grpo.pipeline.agents import AgentPipeline
from grpo.pipeline.base import BatchShape, PipelineContext
from grpo.pipeline.chat_prompts import ChatPrompts
from grpo.pipeline.generation import GenerationHandle
from grpo.pipeline.tool_calls import parse_json_tags
from grpo.tasks.agent_calculator import CalculatorQuestions, calculator
from grpo.trainer.train_batch import IGNORE_INDEX

# A call in the json_tags format, as chatml_tools renders it back: the model is held to it by vLLM's structured
# outputs, so the random tiny model makes one.
TOOL_CALL = r'<tool_call>\{"name": "calculator", "arguments": \{"expression": "[1-9][0-9]\*[1-9][0-9]"\}\}</tool_call>'
# The calculator tool, described briefly: the tiny model's byte tokens make every character a token of a 512-token
# sequence.
TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {}}}
# A reasoning block then an answer.
THINK = r"<think>[a-z]{2,6}</think>[0-9]{1,3}"
# Qwen3's rule: an assistant turn before the conversation's last message loses its <think> block.
STRIP_THINK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.role == 'assistant' and not loop.last %}{{ message.content.split('</think>')[-1] }}"
    "{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2_dir)


# ---------------------------------------------------------------- samples from calls (no server)
def _call(prompt, completion):
    return ModelCall(tuple(prompt), tuple(completion), tuple(-0.5 for _ in completion), "stop", 0, 0)


def test_a_growing_conversation_is_one_sample_and_a_prefix_break_starts_another():
    calls = [_call([1, 2], [3, 4]), _call([1, 2, 3, 4, 9, 9], [5]), _call([1, 2, 7], [6]), _call([1, 2, 7, 6, 8], [2])]
    made = episode_samples(calls)
    assert made.breaks == 1
    first, second = made.samples
    assert first.tokens == [1, 2, 3, 4, 9, 9, 5] and first.calls == [0, 1]
    assert first.masks == [IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX, IGNORE_INDEX, 5]
    assert first.logprobs == [1.0, 1.0, -0.5, -0.5, 1.0, 1.0, -0.5]
    assert second.tokens == [1, 2, 7, 6, 8, 2] and second.calls == [2, 3]
    assert second.masks == [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 6, IGNORE_INDEX, 2]


def test_json_tags_calls_are_parsed_and_anything_else_stays_content():
    turn = parse_json_tags('ok\n<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>', "c")
    assert turn.content == "ok"
    assert turn.tool_calls == [{"id": "c_0", "type": "function",
                                "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}]
    for text in ["no call", "<tool_call>{not json}</tool_call>", '<tool_call>{"name": 3, "arguments": {}}</tool_call>']:
        assert parse_json_tags(text, "c").content == text and not parse_json_tags(text, "c").tool_calls


def test_a_prompt_that_extends_an_earlier_call_keeps_its_tokens(tokenizer):
    """The earlier completion's ids are kept even where tokenizing its text gives other ids (here an id sequence the
    tokenizer would never produce for that text: the special token written as plain bytes)."""
    prompts = ChatPrompts(tokenizer, "chatml_tools")
    first = prompts.render([{"role": "user", "content": "hi"}])
    from grpo.pipeline.chat_prompts import RenderedCall

    # The model wrote "<|im_end|>" character by character: the same text as the end-of-turn token, other ids.
    completion = [i for ch in "yo<|im_end|>" for i in tokenizer.encode(ch, add_special_tokens=False)]
    earlier = RenderedCall(first, prompts.completion_text(completion), tuple(tokenizer.encode(first)), tuple(completion))
    text = prompts.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                           {"role": "user", "content": "and?"}])
    ids = prompts.prompt_ids(text, [earlier])
    assert ids[:len(earlier.prompt_ids) + len(completion)] == [*earlier.prompt_ids, *completion]
    assert tokenizer.decode(ids) == text and ids != tokenizer.encode(text, add_special_tokens=False)
    edited = text.replace("yo", "YO")
    assert prompts.prompt_ids(edited, [earlier]) == tokenizer.encode(edited, add_special_tokens=False)


def test_closing_the_endpoint_cancels_the_episodes_still_running(tokenizer):
    """A rollout batch waiting on its episodes (a producer thread of asynchronous rollouts) ends when the pipeline
    closes, instead of waiting on a loop that stopped."""
    import asyncio
    import concurrent.futures
    import time

    from grpo.pipeline.agent_endpoint import AgentEndpoint, SamplingRules
    from grpo.pipeline.tool_calls import ToolParser

    endpoint = AgentEndpoint(ChatPrompts(tokenizer), ToolParser("json_tags", tokenizer), lambda *a: None,
                             SamplingRules(1.0, 1.0, 8, 512), "policy")
    endpoint.start()
    episodes = endpoint.run(asyncio.sleep(600))
    t0 = time.monotonic()
    endpoint.close()
    with pytest.raises(concurrent.futures.CancelledError):
        episodes.result(timeout=10)
    assert time.monotonic() - t0 < 10


# ---------------------------------------------------------------- against the real server
async def forced_tool_agent(client, item):
    """The calculator agent with its first turn held to a tool call: ask, run the call, ask again."""
    messages = [{"role": "user", "content": item.text}]
    for turn in range(2):
        extra = {"structured_outputs": {"regex": TOOL_CALL}} if turn == 0 else {}
        response = await client.chat.completions.create(model="policy", messages=messages, tools=[TOOL],
                                                        extra_body=extra)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)})
    return float(len(message.content or "") % 3)  # any spread, so the groups carry advantages


async def thinking_agent(client, item):
    """Three turns, each a <think> block then an answer; the template drops earlier turns' blocks."""
    messages = [{"role": "user", "content": item.text}]
    for _ in range(3):
        response = await client.chat.completions.create(model="policy", messages=messages,
                                                        extra_body={"structured_outputs": {"regex": THINK}})
        messages += [{"role": "assistant", "content": response.choices[0].message.content},
                     {"role": "user", "content": "again"}]
    return float(len(messages[-2]["content"]) % 2)


async def refused_agent(client, item):
    """Asks with a temperature other than the run's: refused, and the agent's error is its own."""
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], temperature=0.3)


async def completion_agent(client, item):
    """One /v1/completions request on the bare question."""
    response = await client.completions.create(model="policy", prompt=item.text, max_tokens=8)
    return float(len(response.choices[0].text) % 2)


def _pipeline(server, tokenizer, model_dir, rollout, answers=None, **kw):
    pipeline = AgentPipeline(CalculatorQuestions(min_digits=2, max_digits=2), rollout, prompts_per_step=2,
                             group_size=2, max_new_tokens=100, **kw)
    if answers is not None:  # every answer the server gave, by the prompt ids and the seed it was asked with
        real = pipeline._sample

        def recording(prompt_ids, max_tokens, seed, extra):
            c = real(prompt_ids, max_tokens, seed, extra)
            answers[tuple(prompt_ids), seed] = c
            return c

        pipeline._sample = recording
    pipeline.setup(PipelineContext(
        tokenizer=tokenizer,
        generation=GenerationHandle(lambda: Endpoint(server.url, str(model_dir), 0)), batch_size=4, max_seq_len=512,
        run_dir=REPO, total_steps=10, start_step=0, checkpoint_every=0, seed=0,
        batch_shape=BatchShape(micro_batch_size=64, max_seq_len=512, pad_token_id=tokenizer.pad_token_id)))
    return pipeline


@pytest.fixture(scope="module")
def tool_episodes(vllm_server, tokenizer, tiny_qwen2_dir):
    answers = {}
    pipeline = _pipeline(vllm_server, tokenizer, tiny_qwen2_dir, forced_tool_agent, answers,
                         chat_template="chatml_tools")
    try:
        played = pipeline.play(pipeline.prompts_for_step(0), 0)
        groups, metrics = pipeline.rollout_batch(1)
        yield pipeline, played, answers, groups, metrics
    finally:
        pipeline.close()


@pytest.mark.vllm
def test_each_sample_replays_the_recorded_requests_token_for_token(tool_episodes, tokenizer):
    """One sample per episode (the call the model made renders back as it wrote it); its tokens are the first
    request's prompt, then per request what its prompt adds (masked: the tool's result and the turn markers) and the
    tokens the server sampled (trained, with the server's log-probs); each prompt is the chat template's text of the
    request's messages."""
    pipeline, played, answers, _, metrics = tool_episodes
    prompts = ChatPrompts(tokenizer, "chatml_tools")
    for episode in (p for per_item in played for p in per_item):
        assert episode.error is None and len(episode.log.calls) == 2 and episode.log.tool_calls == 1
        (sample,) = episode.samples.samples
        tokens, masks, logprobs = [], [], []
        for i, (call, request) in enumerate(zip(episode.log.calls, episode.log.requests)):
            assert tokenizer.decode(list(call.prompt_ids)) == prompts.render(request["messages"], request["tools"])
            server = answers[call.prompt_ids, call_seed(episode.log.seed, i)]
            assert list(call.completion_ids) == server.token_ids and list(call.logprobs) == server.logprobs
            assert list(call.prompt_ids[:len(tokens)]) == tokens
            added = list(call.prompt_ids[len(tokens):])
            tokens += added + server.token_ids
            masks += [IGNORE_INDEX] * len(added) + server.token_ids
            logprobs += [1.0] * len(added) + server.logprobs
        assert (sample.tokens, sample.masks, sample.logprobs) == (tokens, masks, logprobs)
        tool = episode.log.requests[1]["messages"][-1]
        assert tool["role"] == "tool"
        added = tokenizer.decode(sample.tokens[len(episode.log.calls[0].prompt_ids) + len(episode.log.calls[0].completion_ids):
                                               len(episode.log.calls[1].prompt_ids)])
        assert f"<|im_start|>tool\n{tool['content']}<|im_end|>" in added
    assert metrics["agent/tool_calls_mean"] == 1.0 and metrics["agent/prefix_breaks"] == 0.0


@pytest.mark.vllm
def test_tool_tokens_get_no_gradient(tool_episodes, tiny_qwen2_dir):
    """Through the batcher and GRPOLoss: the positions between an episode's sampled turns (the tool's result, the
    template's markers) are out of the loss and the loss's gradient wrt the logits there is zero."""
    from conftest import loss_gradient_through_batch, untrained_between_trained

    _, _, _, groups, _ = tool_episodes
    batch, logits, _ = loss_gradient_through_batch(groups, tiny_qwen2_dir)
    between = untrained_between_trained(batch.loss_mask)
    assert between.any(), "no tool tokens between sampled turns"
    assert (batch.labels[between] == IGNORE_INDEX).all()
    assert logits.grad[between].abs().max() == 0
    assert logits.grad[batch.loss_mask > 0].abs().max() > 0


@pytest.mark.vllm
def test_a_template_that_strips_think_makes_one_sample_per_break(vllm_server, tokenizer, tiny_qwen2_dir, tmp_path):
    """Each later request's prompt lacks the earlier turn's <think> block, so it does not extend what the model
    produced: each request is a sample of its own (its exact prompt, masked, then its sampled tokens), the breaks are
    counted, and no sample holds the model's turns as the template rewrote them."""
    template = tmp_path / "strip_think.jinja"
    template.write_text(STRIP_THINK_TEMPLATE)
    answers = {}
    pipeline = _pipeline(vllm_server, tokenizer, tiny_qwen2_dir, thinking_agent, answers, chat_template=str(template))
    try:
        played = [p for per_item in pipeline.play(pipeline.prompts_for_step(0), 0) for p in per_item]
        _, metrics = pipeline.rollout_batch(0)
    finally:
        pipeline.close()
    for episode in played:
        assert episode.error is None and len(episode.log.calls) == 3
        assert episode.samples.breaks == 2 and len(episode.samples.samples) == 3
        for i, (sample, call) in enumerate(zip(episode.samples.samples, episode.log.calls)):
            server = answers[call.prompt_ids, call_seed(episode.log.seed, i)]
            assert sample.tokens == [*call.prompt_ids, *server.token_ids]
            assert sample.masks == [IGNORE_INDEX] * len(call.prompt_ids) + server.token_ids
            assert "<think>" not in tokenizer.decode(list(call.prompt_ids))
        assert "<think>" in tokenizer.decode(list(episode.log.calls[0].completion_ids))
    assert metrics["agent/prefix_breaks"] == 2 * len(played) and metrics["agent/samples_per_episode"] == 3.0


@pytest.mark.vllm
def test_a_completions_request_is_recorded_on_its_text_prompt(vllm_server, tokenizer, tiny_qwen2_dir):
    """/v1/completions: the prompt is the text tokenized whole, `max_tokens` is held to, the sample is the prompt
    (masked) and the sampled tokens."""
    pipeline = _pipeline(vllm_server, tokenizer, tiny_qwen2_dir, completion_agent)
    try:
        played = [p for per_item in pipeline.play(pipeline.prompts_for_step(0), 0) for p in per_item]
    finally:
        pipeline.close()
    for episode in played:
        (call,) = episode.log.calls
        assert episode.error is None and call.kind == "completion" and 1 <= len(call.completion_ids) <= 8
        assert list(call.prompt_ids) == tokenizer.encode(episode.item.text, add_special_tokens=False)
        (sample,) = episode.samples.samples
        assert sample.tokens == [*call.prompt_ids, *call.completion_ids]
        assert sample.masks == [IGNORE_INDEX] * len(call.prompt_ids) + list(call.completion_ids)


@pytest.mark.vllm
def test_the_endpoint_refuses_what_it_cannot_serve_exactly(vllm_server, tokenizer, tiny_qwen2_dir):
    """A temperature other than the run's is an HTTP 400 the agent sees (openai.BadRequestError), counted; a batch
    whose every episode failed raises the agent's error."""
    import openai

    pipeline = _pipeline(vllm_server, tokenizer, tiny_qwen2_dir, refused_agent)
    try:
        played = [p for per_item in pipeline.play(pipeline.prompts_for_step(0), 0) for p in per_item]
        assert all(isinstance(p.error, openai.BadRequestError) and "data.temperature" in str(p.error) for p in played)
        assert all(p.log.refused == 1 and not p.log.calls for p in played)
        with pytest.raises(RuntimeError, match="every episode of step 0 failed"):
            pipeline.rollout_batch(0)
    finally:
        pipeline.close()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("extra", [
    pytest.param([], id="synchronous"),
    # Asynchronous rollouts: the next step's episodes play beside this step's update, one weight version behind;
    # each sample still carries the version its requests were served at.
    pytest.param(["train.max_staleness=1"], id="asynchronous", marks=pytest.mark.slow),
])
def test_agent_calculator_tiny_trains(train_server, tiny_qwen2_dir, tmp_path, extra):
    """experiment=agent_calculator_tiny: the openai-SDK calculator agent trains 3 steps on the CPU engine (smaller
    steps than the experiment's, same code), synchronously and with asynchronous rollouts."""
    override, env = attach(train_server, tiny_qwen2_dir)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "train.py", "experiment=agent_calculator_tiny", override, f"hydra.run.dir={run_dir}",
           "data.prompts_per_step=2", "data.group_size=4", "data.max_new_tokens=16", "train.micro_batch_size=8",
           "train.grad_accum=1", "model.max_seq_len=512", *extra]
    done = subprocess.run(cmd, cwd=REPO, env={**__import__("os").environ, **env}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "agent/requests_mean" in r]
    assert len(steps) == 3 and all(r["agent/requests_mean"] >= 1 and r["tokens/trained"] > 0 for r in steps)
    if extra:  # the episodes of a later step were played by the weights one step before
        assert max(r.get("async/staleness_max", 0) for r in steps) == 1


@pytest.mark.vllm
def test_a_vllm_tool_parser_reads_the_calls_of_its_format(tokenizer):
    """tool_parser=hermes is vLLM's own Hermes parser, returning the calls in the OpenAI format; a name that is no
    parser is refused with the list of vLLM's."""
    from grpo.pipeline.tool_calls import ToolParser

    with pytest.raises(ValueError, match="neither 'json_tags', 'calc_lines' nor a vLLM tool parser; vLLM has: .*hermes"):
        ToolParser("no_such_parser", tokenizer)
    request = {"model": "policy", "messages": [{"role": "user", "content": "2*3"}],
               "tools": [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]}
    turn = ToolParser("hermes", tokenizer).parse(
        'let me\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>', request, "c")
    assert [c["function"]["name"] for c in turn.tool_calls] == ["calculator"]
    assert json.loads(turn.tool_calls[0]["function"]["arguments"]) == {"expression": "2*3"}
    assert turn.content.strip() == "let me"
    assert not ToolParser("hermes", tokenizer).parse("no call", request, "c").tool_calls


# ---------------------------------------------------------------- SmolLM2's warm start (model=smollm2_135m_warm_calc)
def test_smollm2_warm_start_demonstrations_are_the_agents_calls_in_its_template(tmp_path):
    """The preset's demonstrations are what experiment=smollm2_agent_calculator_warm's agent sends and would parse:
    the first turn's prompt is the endpoint's rendering of the agent's first request (chat_template chatml_tools,
    SmolLM2's tokenizer), the labelled turns are a <tool_call> block that tool_calls' json_tags parser reads back as
    the calculator call of the item's expression, then the tool's value (or, in the other episodes, the product at
    once); the items are the experiment's task's training items (its held-out set, never drawn)."""
    import random as _random

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from grpo.conf import CONFIG_DIR
    from grpo.config import register_configs
    from grpo.models.packaged import build_packaged_model_dir
    from grpo.pipeline.tool_calls import ToolParser
    from grpo.recipes.chat_demos import ChatEpisodes
    from grpo.recipes.warmstart import WARMSTART_PRESETS
    from grpo.tasks.agent_calculator import CALCULATOR_TOOL, SYSTEM

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=smollm2_agent_calculator_warm"])
    preset = WARMSTART_PRESETS[cfg.model.offline]
    assert preset["chat_template"] == cfg.data.chat_template and cfg.data.tool_parser == "json_tags"
    task = instantiate(preset["task"])
    assert task.eval_prompts() == instantiate(OmegaConf.to_container(cfg.data.task)).eval_prompts()
    tokenizer = AutoTokenizer.from_pretrained(build_packaged_model_dir(preset["base"], progress=False))
    task.bind_tokenizer(tokenizer)
    episodes = ChatEpisodes(instantiate(preset["teacher"]), tokenizer, preset["chat_template"])
    parser = ToolParser(cfg.data.tool_parser, tokenizer)
    heldout = {p.text for p in task.eval_prompts()}
    rng = _random.Random(0)
    request = [{"role": "system", "content": SYSTEM}]
    calls = 0
    for item in task.sample(rng, 12):
        assert item.text not in heldout
        ids, labels = episodes.episode(task, item, rng, tokenizer)
        first = next(i for i, lab in enumerate(labels) if lab != IGNORE_INDEX)
        asked = [*request, {"role": "user", "content": item.text}]
        assert ids[:first] == tokenizer.encode(ChatPrompts(tokenizer, "chatml_tools").render(asked, [CALCULATOR_TOOL]),
                                               add_special_tokens=False)
        turns = tokenizer.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]).split(tokenizer.eos_token)
        assert turns[-2:] == [item.answer, ""]
        if len(turns) == 2:  # answered at once, without a call
            assert not parser.parse(turns[0], {"messages": asked, "tools": [CALCULATOR_TOOL]}, "c").tool_calls
            continue
        calls += 1
        call = parser.parse(turns[0], {"messages": asked, "tools": [CALCULATOR_TOOL]}, "c")
        assert call.content is None and [c["function"]["name"] for c in call.tool_calls] == ["calculator"]
        assert json.loads(call.tool_calls[0]["function"]["arguments"]) == {"expression": task.expression_of(item)}
        assert calculator(call.tool_calls[0]["function"]["arguments"]) == item.answer
    assert 0 < calls < 12  # the preset's share of calling episodes, drawn


@pytest.mark.slow  # SmolLM2 loaded, one supervised step of 2 episodes and a small measure: ~1-2 min on 2 loaded cores
def test_the_smollm2_warm_start_builds_from_the_packaged_model_and_measures_its_calls(monkeypatch, tmp_path):
    """The preset smollm2-135m-warm-calc (shortened) builds from the packaged SmolLM2 with the chat teacher and writes
    its measure: the share of sampled first turns that are calls, and of those the teacher's call, and the accuracy
    without the tool."""
    import copy

    from grpo.recipes import warmstart

    preset = copy.deepcopy(warmstart.WARMSTART_PRESETS["smollm2-135m-warm-calc"])
    preset["task"]["heldout_size"] = 2
    preset["sft"].update(steps=1, batch_size=2, warmup_steps=1)
    preset["measure"].update(sample_prompts=2, sample_n=2, max_new_tokens=4)
    monkeypatch.setattr(warmstart, "WARMSTART_PRESETS", {**warmstart.WARMSTART_PRESETS, "smollm2-135m-warm-calc": preset})
    meta = warmstart.read_metadata(warmstart.build_warmstart_dir("smollm2-135m-warm-calc", out_dir=tmp_path / "warm",
                                                                  progress=False))
    assert meta["spec"]["sft"]["steps"] == 1 and meta["heldout_items"] == 2
    assert 0 <= meta["first_turn_right_call_rate"] <= meta["first_turn_call_rate"] <= 1
    assert 0 <= meta["no_tool_greedy_accuracy"] <= 1
