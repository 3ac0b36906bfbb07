"""Held-out accuracy against training seconds (evaluation time taken out on both sides) for the real-model runs of
bench/gpu/real_model.sh: ours (metrics.jsonl of `train`) and TRL (the JSON of `trl`), one PNG and a Markdown table;
and the per-layout runs (``layout_<mode>_<what>.metrics.jsonl``) in a second PNG, ``layouts.png``.

    python bench/gpu/real_model_curves.py bench/results/gpu/real_model
    python bench/gpu/real_model_curves.py bench/results/gpu/real_model/lease5   # a folder of ours_*.metrics.jsonl,
        # trl_s*.json, algo_*.metrics.jsonl and layout_*.metrics.jsonl (bench/gpu/run_plan.py's results):
        # curves.png, algorithms.png, layouts.png, table.md
    python bench/gpu/real_model_curves.py FOLDER "shared_vllm, 1 GPU=shared_s0" "broadcast, 2 GPUs=bcast_s0" "TRL=trl_s0"
        # layouts.png and table.md of those runs (label=run name of a plan; a TRL run's <name>.json), e.g. lease 8's
    python bench/gpu/real_model_curves.py FOLDER --pairs shared_s1:trl_s1 shared_s2:trl_s2
        # pairs.png and pairs.md: each of our runs against the TRL run beside it (the same seed), e.g. lease 9's
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_files import exists, find, read_rows, read_text  # noqa: E402


def ours_curve(path: Path) -> list[tuple[int, float, float]]:
    """(step, accuracy, training seconds) of a metrics.jsonl: time/run_seconds less the evaluations so far."""
    out, eval_s = [], 0.0
    for r in read_rows(path):
        if "eval/accuracy" in r:
            eval_s += r.get("eval/seconds", 0.0)
            out.append((r["step"], r["eval/accuracy"], max(0.0, r["time/run_seconds"] - eval_s)))
    return out


def trl_curve(path: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["eval/accuracy"], r["time/train_seconds"]) for r in json.loads(read_text(path))["rows"]]


def first_reach(curve: list[tuple[int, float, float]], target: float) -> float | None:
    return next((t for _, acc, t in curve if acc >= target), None)


def save_accuracy_plot(fig, ax, title: str, path: Path, legend_fontsize: int | None = None) -> None:
    """The axes, title, grid and legend every plot here shares, then the PNG at `path`."""
    ax.set_xlabel("training seconds (evaluations taken out)")
    ax.set_ylabel("held-out greedy accuracy (500 items)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(folder: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    root = Path(folder)
    if find(root, "ours_*.metrics.jsonl"):
        compare(root, plt)
        return
    curves = {f"ours {p.name.split('_')[2].split('.')[0]}": ours_curve(p) for p in find(root, "lr3e-5_250steps_s*.metrics.jsonl")}
    trl = {f"TRL {p.stem.split('_')[1]}": trl_curve(p) for p in find(root, "trl_s*.json")}
    target = sum(c[-1][1] for c in trl.values()) / len(trl)
    lines = ["| run | accuracy at steps 0, 50, ..., 250 | training s | s to TRL's final (%.3f) | / TRL's s |" % target,
             "|---|---|---|---|---|"]
    trl_s = sum(c[-1][2] for c in trl.values()) / len(trl)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, curve in {**curves, **trl}.items():
        ax.plot([t for *_, t in curve], [a for _, a, _ in curve], marker="o", ls="--" if name.startswith("TRL") else "-",
                label=name)
        reach = first_reach(curve, target)
        lines.append(f"| {name} | {', '.join(f'{a:.3f}' for _, a, _ in curve)} | {curve[-1][2]:.0f} | "
                     f"{'never' if reach is None else f'{reach:.0f}'} | "
                     f"{'-' if reach is None else f'{reach / trl_s:.2f}'} |")
    save_accuracy_plot(fig, ax, "SmolLM2-135M-Instruct, chat arithmetic, one H100", root / "curves.png")
    (root / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot_layouts(root, plt)


def compare(root: Path, plt) -> None:
    """Each of our runs against each TRL run: the training seconds ours took to first reach TRL's final accuracy, over
    TRL's training seconds; curves.png (ours and TRL) and algorithms.png (the algo_* runs beside ours seed 0)."""
    ours = {p.name.split(".")[0][5:]: ours_curve(p) for p in find(root, "ours_*.metrics.jsonl")}
    trl = {p.stem: trl_curve(p) for p in find(root, "trl_s*.json")}
    lines = ["| run | accuracy at steps 0, 50, ..., 250 | training s at 250 | "
             + " | ".join(f"to {t}'s final {c[-1][1]:.3f} ({c[-1][2]:.0f} s): s, ratio" for t, c in trl.items()) + " |",
             "|---|---|---|" + "---|" * len(trl)]
    for name, curve in {**ours, **trl}.items():
        cells = []
        for c in trl.values():
            reach = first_reach(curve, c[-1][1])
            cells.append("never" if reach is None else f"{reach:.0f} s, {reach / c[-1][2]:.2f}x")
        lines.append(f"| {name} | {', '.join(f'{a:.3f}' for _, a, _ in curve)} | {curve[-1][2]:.0f} | "
                     + " | ".join(cells) + " |")
    for filename, runs in (("curves.png", {**ours, **trl}),
                           ("algorithms.png", {"grpo (ours sync_s0)": ours.get("sync_s0", []),
                                               **{p.name.split(".")[0][5:]: ours_curve(p)
                                                  for p in find(root, "algo_*.metrics.jsonl")}})):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name, curve in runs.items():
            ax.plot([t for *_, t in curve], [a for _, a, _ in curve], marker="o",
                    ls="--" if name.startswith("trl") else "-", label=name)
        save_accuracy_plot(fig, ax, "SmolLM2-135M-Instruct, chat arithmetic, one H100", root / filename, 8)
    (root / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if find(root, "layout_*.metrics.jsonl"):
        plot_layouts(root, plt)


def plot_layouts(root: Path, plt, runs: dict[str, str] | None = None) -> None:
    """Held-out accuracy against training seconds of each layout's run, one line per file: the `layout_*` files, or
    `runs` (label -> run name, e.g. {"broadcast, 2 GPUs": "bcast_s0"}: `<name>.metrics.jsonl` in `root`, or TRL's
    `<name>.json`, drawn dashed). With a TRL run among `runs`, table.md says when each run first reached TRL's final
    accuracy, and that time over TRL's."""
    paths = {label: root / f"{name}.metrics.jsonl" for label, name in (runs or {}).items()} or {
        p.name.split(".")[0][7:]: p for p in find(root, "layout_*.metrics.jsonl")}
    trl_labels = [label for label, path in paths.items() if not exists(path)]  # a TRL run: <name>.json instead
    curves = {label: trl_curve(path.with_name(path.name.split(".")[0] + ".json")) if label in trl_labels else
              ours_curve(path) for label, path in paths.items()}
    trl = [curves[label] for label in trl_labels]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    lines = ["| run | accuracy at each evaluation | training s at the end |"
             + (f" s to TRL's final {trl[0][-1][1]:.3f} | / TRL's {trl[0][-1][2]:.0f} s |" if trl else ""),
             "|---|---|---|" + ("---|---|" if trl else "")]
    for label, curve in curves.items():
        ax.plot([t for *_, t in curve], [a for _, a, _ in curve], marker="o", label=label,
                ls="--" if label in trl_labels else "-")
        cells = [label, ", ".join(f"{a:.3f}" for _, a, _ in curve), f"{curve[-1][2]:.0f}"]
        if trl:
            reach = first_reach(curve, trl[0][-1][1])
            cells += ["never"] * 2 if reach is None else [f"{reach:.0f}", f"{reach / trl[0][-1][2]:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    save_accuracy_plot(fig, ax, "SmolLM2-135M-Instruct, chat arithmetic, per layout (H100s)", root / "layouts.png", 8)
    if runs:
        (root / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def pair_rows(pairs: dict[tuple[str, str], tuple[list, list]]) -> list[str]:
    """One Markdown row per (our run, TRL run) -> (our curve, TRL's curve): both curves' accuracies, training seconds,
    TRL's final accuracy, when ours first reached it and that time over TRL's; and ours' best accuracy within 0.5x
    TRL's seconds."""
    lines = ["| ours | TRL | ours: accuracy at each evaluation (training s at the end) | TRL: accuracy at each "
             "evaluation (training s) | TRL's final | ours first reaches it: s, / TRL's | ours' best within 0.5x "
             "TRL's s |", "|---|---|---|---|---|---|---|"]
    for (ours_name, trl_name), (ours, trl) in pairs.items():
        (_, target, trl_s), reach = trl[-1], first_reach(ours, trl[-1][1])
        best = max((a for _, a, t in ours if t <= 0.5 * trl_s), default=float("nan"))
        lines.append(f"| {ours_name} | {trl_name} | {', '.join(f'{a:.3f}' for _, a, _ in ours)} ({ours[-1][2]:.0f}) | "
                     f"{', '.join(f'{a:.3f}' for _, a, _ in trl)} ({trl_s:.0f}) | {target:.3f} | "
                     + ("never" if reach is None else f"{reach:.0f} s, {reach / trl_s:.2f}x") + f" | {best:.3f} |")
    return lines


def plot_pairs(root: Path, plt, pairs: list[tuple[str, str]]) -> None:
    """pairs.png (one colour per pair, TRL dashed) and pairs.md (pair_rows) in `root`."""
    curves = {(ours, trl): (ours_curve(root / f"{ours}.metrics.jsonl"), trl_curve(root / f"{trl}.json"))
              for ours, trl in pairs}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for colour, (names, pair) in enumerate(curves.items()):
        for name, curve, style in zip(names, pair, ("-", "--")):
            ax.plot([t for *_, t in curve], [a for _, a, _ in curve], marker="o", ls=style, color=f"C{colour}",
                    label=name)
    save_accuracy_plot(fig, ax, "SmolLM2-135M-Instruct, ours and TRL side by side (H100s)", root / "pairs.png", 8)
    lines = pair_rows(curves)
    (root / "pairs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 2:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if sys.argv[2] == "--pairs":  # FOLDER --pairs OURS:TRL ...
            plot_pairs(Path(sys.argv[1]), plt, [tuple(arg.split(":", 1)) for arg in sys.argv[3:]])
        else:  # FOLDER LABEL=RUN ...: the layouts plot of those runs only
            plot_layouts(Path(sys.argv[1]), plt, dict(arg.rsplit("=", 1) for arg in sys.argv[2:]))
    else:
        main(sys.argv[1])
