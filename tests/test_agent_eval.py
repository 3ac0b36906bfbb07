"""The held-out evaluation of an agent (grpo.pipeline.agent_eval) and the warm calculator model's call format
(tool_parser and chat_template calc_lines): an agent's data is evaluated on whole episodes of the agent, greedy and
sampled, scored by what the rollout returns; the calculator agent's requests reach model=warm_calc as the very
prompts of data=calculator."""

from __future__ import annotations

import pytest

from grpo.pipeline.agents import AgentPipeline
from grpo.pipeline.chat_prompts import ChatPrompts
from grpo.pipeline.generation import GenerationHandle
from grpo.pipeline.tool_calls import CALC_INSTRUCTION, ToolParser
from grpo.tasks.agent_calculator import CALCULATOR_TOOL, SYSTEM, CalculatorQuestions, calculator
from grpo.tasks.calculator import TOOL_INSTRUCTION, LongArithmeticTask

# A call in warm-calc's format, held to by vLLM's structured outputs so the random tiny model makes one.
CALC_CALL = r"calc: [1-9][0-9]\*[1-9][0-9]"


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2_dir)


# ---------------------------------------------------------------- calc_lines (no server)
def test_the_calculator_agent_reaches_the_warm_start_with_data_calculators_prompts(tokenizer):
    """With tools, calc_lines renders the agent's request as data=calculator's prompt with the tool, token for token;
    a call parsed from ``calc: <expression>`` renders back as the model wrote it, the tool's answer as data=calculator's
    tool turn; without tools the question alone is data=calculator's prompt without the tool."""
    assert CALC_INSTRUCTION == TOOL_INSTRUCTION
    prompts, parser = ChatPrompts(tokenizer, "calc_lines"), ToolParser("calc_lines", tokenizer)
    with_tool, without = LongArithmeticTask(), LongArithmeticTask(tool=False)
    questions = CalculatorQuestions()
    for task in (with_tool, without, questions):
        task.bind_tokenizer(tokenizer)
    for item, asked, plain in zip(questions.eval_prompts()[:4], with_tool.eval_prompts(), without.eval_prompts()):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": item.text}]
        first = prompts.render(messages, [CALCULATOR_TOOL])
        assert first == asked.text
        assert prompts.render([{"role": "user", "content": item.text}]) == plain.text
        turn = parser.parse(f"calc: {item.text[:-1]}", {}, "c")
        assert turn.content is None and [c["function"]["name"] for c in turn.tool_calls] == ["calculator"]
        value = calculator(turn.tool_calls[0]["function"]["arguments"])
        assert value == item.answer
        messages += [{"role": "assistant", "content": None, "tool_calls": turn.tool_calls},
                     {"role": "tool", "tool_call_id": "c_0", "content": value}]
        assert prompts.render(messages, [CALCULATOR_TOOL]) == (
            f"{first}calc: {item.text[:-1]}<|im_end|>\n<|im_start|>tool\n{value}<|im_end|>\n<|im_start|>assistant\n")
    for text in ("123", "calc:", "the answer is calc: 1*2"):
        assert parser.parse(text, {}, "c").tool_calls == [] and parser.parse(text, {}, "c").content == text


def test_an_agents_data_is_evaluated_on_its_episodes_unless_eval_task_names_prompts():
    """eval.enabled null: an agent's data gets the AgentEvaluator (the agent's own items, played as episodes), with
    the data's rollout and format; an eval.task of its own gets the plain evaluator."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.conf import CONFIG_DIR
    from grpo.config import register_configs
    from grpo.pipeline.agent_eval import AgentEvaluator
    from grpo.pipeline.evaluation import Evaluator, build_evaluator

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=agent_calculator_warm", "eval.enabled=null"])
        own = compose(config_name="train", overrides=[
            "experiment=agent_calculator_warm", "+eval.task._target_=grpo.tasks.calculator.LongArithmeticTask",
            "+eval.rewards.correct._target_=grpo.tasks.calculator.LongAnswerReward"])
    evaluator = build_evaluator(cfg.eval, cfg.data)
    assert isinstance(evaluator, AgentEvaluator)
    assert (evaluator.chat_template, evaluator.tool_parser_name, evaluator.max_new_tokens) == ("calc_lines",
                                                                                              "calc_lines", 24)
    assert evaluator.rollout.__name__ == "calculator_agent" and len(evaluator.prompts) == 0  # set up by the run
    plain = build_evaluator(own.eval, own.data)
    assert type(plain) is Evaluator


def test_a_users_agent_pipeline_is_evaluated_on_its_episodes_by_what_it_declares():
    """The evaluator of the data's own episodes is the data class's `episode_evaluator`, so a subclass of
    AgentPipeline (a user's own agent data) gets the AgentEvaluator as the built-in one does."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.conf import CONFIG_DIR
    from grpo.config import register_configs
    from grpo.pipeline.agent_eval import AgentEvaluator
    from grpo.pipeline.evaluation import build_evaluator

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=agent_calculator_warm", "eval.enabled=null",
                                                      f"data._target_={__name__}.MyAgentPipeline"])
    assert isinstance(build_evaluator(cfg.eval, cfg.data), AgentEvaluator)


class MyAgentPipeline(AgentPipeline):
    """A user's own agent data source."""


# ---------------------------------------------------------------- against the real server
async def parity_agent(client, item):
    """A forced calc call, its result sent back, an answer; scores 1 when the item's answer is even (known ahead, so
    the evaluator's accuracy can be checked), raises on items whose answer ends in 5."""
    messages = [{"role": "user", "content": item.text}]
    response = await client.chat.completions.create(
        model="policy", messages=messages, tools=[CALCULATOR_TOOL],
        extra_body={"structured_outputs": {"regex": CALC_CALL}})
    message = response.choices[0].message
    assert message.tool_calls, message
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                  "content": calculator(message.tool_calls[0].function.arguments)}]
    await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL],
                                         extra_body={"structured_outputs": {"regex": "[0-9]{1,4}"}})
    if item.answer.endswith("5"):
        raise RuntimeError("an agent's own error")
    return float(int(item.answer) % 2 == 0)


@pytest.mark.vllm
def test_the_evaluator_plays_whole_agent_episodes(vllm_server, tokenizer, tiny_qwen2_dir, tmp_path):
    """Greedy accuracy is the share of episodes the rollout scored 1, a raising rollout scores 0 and is unparsed;
    each episode is two requests, the second prompt extending the first (one sample), the response tokens are both
    requests' sampled tokens; greedy episodes are the same when played again, sampled ones are seeded apart."""
    from grpo.inference.client import Endpoint
    from grpo.pipeline.agent_eval import AgentEvaluator
    from grpo.pipeline.evaluation import EvalContext

    task = CalculatorQuestions(min_digits=2, max_digits=2, heldout_size=8)
    evaluator = AgentEvaluator(parity_agent, chat_template="calc_lines", tool_parser="calc_lines", max_requests=2,
                               task=task, rewards=None, k=2, samples_per_prompt=2, max_new_tokens=12)
    evaluator.setup(EvalContext(tokenizer=tokenizer,
                                generation=GenerationHandle(lambda: Endpoint(vllm_server.url, None, 0)),
                                run_dir=tmp_path, seed=0, total_steps=2, max_seq_len=512))
    try:
        generated = evaluator.generate(0)
        again = evaluator.generate(1, sampled=False)
        metrics = evaluator.score(generated)
    finally:
        evaluator.close()
    items = task.eval_prompts()
    raising = [i.answer.endswith("5") for i in items]
    even = [int(i.answer) % 2 == 0 and not r for i, r in zip(items, raising)]
    assert 0 < sum(even) < len(items)
    assert metrics["eval/accuracy"] == sum(even) / len(items)
    assert metrics["eval/mean@k"] == sum(even) / len(items)
    assert metrics["eval/unparsed_fraction"] == sum(raising) / len(items)
    greedy = [per_item[0] for per_item in generated.greedy]
    for episode in greedy:
        first, second = episode.log.calls
        assert episode.samples.breaks == 0 and len(episode.samples.samples) == 1
        assert second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == (
            first.prompt_ids + first.completion_ids)
    tokens = [len(e.log.calls[0].completion_ids) + len(e.log.calls[1].completion_ids) for e in greedy]
    assert metrics["eval/response_tokens_mean"] == sum(tokens) / len(tokens)
    replay = [per_item[0] for per_item in again.greedy]
    assert [[c.completion_ids for c in e.log.calls] for e in greedy] == [
        [c.completion_ids for c in e.log.calls] for e in replay]
    assert again.sampled is None
    calls = [[c.completion_ids for c in e.log.calls] for per_item in generated.sampled for e in per_item]
    assert len(calls) == 2 * len(items) and len({str(c) for c in calls}) > len(items)
