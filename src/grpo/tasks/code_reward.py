"""A reward that runs the program of a completion against the prompt's hidden tests in the bubblewrap sandbox
(grpo.tasks.sandbox): 1.0 when every test passes, else 0.0. Results are cached per distinct (program, tests) pair.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from typing import Optional

from grpo.tasks.prompts import Prompt
from grpo.tasks.sandbox import SandboxLimits, SandboxResult, check_sandbox, run_sandboxed

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_program(completion: str) -> str:
    """The program a completion states: its last ``` fenced block (```python or bare; an unclosed fence runs to the
    end), else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def compiles(program: str) -> bool:
    """Whether `program` is valid Python (compiled here, never run: compiling executes nothing)."""
    try:
        compile(program, "solution.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


class SandboxedTestsReward:
    """1.0 when the completion's program (extract_program) passes the prompt's tests (`prompt.answer`: Python source
    that asserts on the program's names), run together in the bubblewrap sandbox under the given limits; else 0.0.

    A program that does not compile scores 0 without a run. Each distinct (program, tests) pair runs once; the last
    `cache_size` results are kept. Construction fails with SandboxUnavailable (saying what to install) where bwrap
    cannot run a sandbox: a program is never run outside one.
    """

    def __init__(self, timeout_s: float = 2.0, memory_mb: int = 512, output_kb: int = 64, box_mb: int = 16,
                 cache_size: int = 4096) -> None:
        if timeout_s <= 0 or memory_mb < 64 or output_kb < 1 or box_mb < 1 or cache_size < 0:
            raise ValueError("SandboxedTestsReward needs timeout_s > 0, memory_mb >= 64 (the interpreter's own), "
                             f"output_kb >= 1, box_mb >= 1, cache_size >= 0; got {timeout_s}, {memory_mb}, "
                             f"{output_kb}, {box_mb}, {cache_size}")
        check_sandbox()
        self.limits = SandboxLimits(timeout_s=float(timeout_s), memory_bytes=int(memory_mb) * 2**20,
                                    output_bytes=int(output_kb) * 2**10, box_bytes=int(box_mb) * 2**20)
        self.cache_size = int(cache_size)
        self._cache: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        # Sandboxed runs made by this object (the cache's misses), for tests and metrics.
        self.runs = 0

    def run(self, program: str, tests: str) -> SandboxResult:
        """One sandboxed run of `program` and `tests` under this reward's limits (no cache)."""
        with self._lock:
            self.runs += 1
        return run_sandboxed(program, tests, self.limits)

    def score(self, program: str, tests: str) -> float:
        """1.0 when `program` passes `tests` in the sandbox, else 0.0; cached per distinct pair."""
        key = hashlib.sha256(f"{len(program)}:{program}{tests}".encode()).hexdigest()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        value = 1.0 if compiles(program) and self.run(program, tests).passed else 0.0
        with self._lock:
            self._cache[key] = value
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return value

    def __call__(self, prompt: Prompt, completion: str) -> float:
        tests: Optional[str] = prompt.answer
        if not tests:
            raise ValueError("SandboxedTestsReward grades against the prompt's tests (Prompt.answer), and this prompt "
                             "has none: use a task whose answers are test code (grpo.tasks.coding_task.CodingTask)")
        return self.score(extract_program(completion), tests)

    def parses(self, prompt: Prompt, completion: str) -> bool:  # noqa: ARG002
        """Whether the completion states a program that compiles (the evaluator counts those that don't)."""
        return compiles(extract_program(completion))
