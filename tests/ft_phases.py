"""Fault injection from outside the ranks of ``examples/elastic.py``, at a chosen phase
(``tests/test_ft_faults.py``).

Each replica logs every phase it enters (one JSON line, appended: which process, its
``RANK``, the phase, its committed step, quorum and rank, and after a commit the hash
of its parameters) through :class:`PhaseHook`, which the example calls. A *pause*
``(rank, phase, step, seconds)`` makes that replica linger in that phase, after logging
``paused``: the test, watching the log, then SIGKILLs or SIGSTOPs it from outside, so
the fault lands in that phase every time (an outside kill at a random moment would land
in whichever phase is longest).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any, Callable, Optional


class PhaseHook:
    """Log phases to ``log_path``; linger ``seconds`` at each ``(rank, phase, step,
    seconds)`` of ``pauses`` (once per process); sleep ``step_s`` before every step, as
    a larger model's compute would (so that a replacement, which takes a second to start,
    joins a run that is still going)."""

    def __init__(self, log_path: str, pauses: tuple = (), step_s: float = 0.0) -> None:
        self.log_path, self.pauses, self.step_s = log_path, tuple(pauses), step_s
        self._done: set = set()

    def __call__(self, phase: str, manager: Any, model: Any) -> None:
        rank_env = int(os.environ.get("RANK", "-1"))
        line = {"pid": os.getpid(), "rank_env": rank_env, "phase": phase,
                "step": manager.step, "quorum_id": manager.quorum_id, "rank": manager.rank,
                "size": manager.size, "healed": manager.stats["healed"]}
        if phase == "committed":
            line["digest"] = manager.digest(model.parameters())
        self._write(line)
        if phase == "before_step" and self.step_s:
            time.sleep(self.step_s)
        for pause in self.pauses:
            r, ph, st, seconds = pause
            if (r, ph) == (rank_env, phase) and manager.step >= st and pause not in self._done \
                    and manager.stats["healed"] == 0:
                self._done.add(pause)
                self._write(dict(line, phase="paused", paused_in=phase))
                time.sleep(seconds)

    def _write(self, line: dict) -> None:
        data = (json.dumps(line) + "\n").encode()
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)   # one write of a short line with O_APPEND: not torn
        finally:
            os.close(fd)


def read_log(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


class Injector:
    """Watches the log from a thread; at each ``paused`` line runs ``action(pid, line)``
    (at most ``count`` times)."""

    def __init__(self, log_path: str, action: Callable[[int, dict], None],
                 count: int = 1) -> None:
        self.log_path, self.action, self.count = log_path, action, count
        self.fired: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        seen = 0
        while not self._stop.is_set() and len(self.fired) < self.count:
            lines = read_log(self.log_path)
            for line in lines[seen:]:
                if line["phase"] == "paused" and len(self.fired) < self.count:
                    self.fired.append(dict(line, at=time.time()))
                    self.action(line["pid"], line)
            seen = len(lines)
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


def sigkill(pid: int, line: dict) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def sigstop_for(seconds: float) -> Callable[[int, dict], None]:
    """SIGSTOP the process, SIGCONT it ``seconds`` later (from a timer thread)."""
    def action(pid: int, line: dict) -> None:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        threading.Timer(seconds, lambda: _cont(pid)).start()
    return action


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def check_consistency(lines: list[dict], finished_pids: Optional[set] = None) -> list[str]:
    """What the log shows went wrong: replicas whose parameters differ after the same
    committed step, and steps applied by some but not all of their surviving
    participants. Empty when all is well."""
    problems = []
    by_step: dict[int, set] = {}
    for line in lines:
        if line["phase"] == "committed":
            by_step.setdefault(line["step"], set()).add(line["digest"])
    for step, digests in sorted(by_step.items()):
        if len(digests) > 1:
            problems.append(f"after step {step}: {len(digests)} different parameter hashes")
    if finished_pids:
        tried: dict[tuple, set] = {}
        applied: dict[tuple, set] = {}
        for line in lines:
            if line["pid"] not in finished_pids:
                continue
            key = (line["quorum_id"], line["step"])
            if line["phase"] == "before_commit":
                tried.setdefault(key, set()).add(line["pid"])
            elif line["phase"] == "committed":   # logged with the step after it
                applied.setdefault((line["quorum_id"], line["step"] - 1), set()).add(
                    line["pid"])
        for key, pids in applied.items():
            if pids != tried.get(key, set()):
                problems.append(f"quorum {key[0]} step {key[1]}: applied by {sorted(pids)}, "
                                f"tried by {sorted(tried.get(key, set()))}")
    return problems
