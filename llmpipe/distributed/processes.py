"""The worker processes rank 0 starts on this machine (ranks 1..N-1), and ending them.

Each is a fresh `python -m llmpipe.distributed.worker` rather than a multiprocessing "spawn"
child: spawn re-imports the caller's __main__ in every child, so an unguarded script calling
LLM(...) at top level would fail with multiprocessing's bootstrapping error (and a guarded one
would still re-run its imports). A worker whose rank 0 disappears without closing the engine
(killed) leaves on its own: its gloo connections to rank 0 close.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import llmpipe

logger = logging.getLogger(__name__)


class LocalWorkers:
    def __init__(self, world: int, port: int):
        env = dict(os.environ)  # the caller's llmpipe, even when it is not installed
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(llmpipe.__file__).parents[1]), env.get("PYTHONPATH")]))
        self.processes = [
            subprocess.Popen(
                [sys.executable, "-m", "llmpipe.distributed.worker", str(rank), str(world), str(port)],
                env=env, stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches rank 0 only, which then stops the workers
            )
            for rank in range(1, world)
        ]

    def dead(self) -> list[str]:
        """'rank R (pid P) <how it ended>' for each worker that has exited."""
        return [f"rank {rank} (pid {p.pid}) {exit_reason(p.returncode)}"
                for rank, p in enumerate(self.processes, start=1) if p.poll() is not None]

    def reap(self, wait_s: float) -> None:
        """Give workers that are going down wait_s to be reaped, so dead() can say how they ended."""
        for process in self.processes:
            try:
                process.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass

    def stop(self, grace_s: float) -> None:
        """Wait grace_s for the workers to leave, then kill the rest (SIGKILL: also ends a stopped or
        hung process); reap them all."""
        self.reap(grace_s)
        for process in self.processes:
            if process.poll() is None:
                logger.warning("tensor-parallel worker pid %d did not stop; killing it", process.pid)
                process.kill()
                process.wait()


def exit_reason(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"
