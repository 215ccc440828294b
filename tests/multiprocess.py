"""Running a test body on several gloo ranks: ``run_ranks(worker, args)`` spawns them, each
calling ``worker(rank, port, out_dir, *args)`` and writing ``rank{N}.json`` into ``out_dir``;
it returns those answers, re-raises a rank's exception with its traceback, and kills ranks
that outlive the deadline (a hang fails the test instead of stalling CI)."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)


def answer(out_dir: str, rank: int, result: dict) -> None:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _exit_when_done(rank: int, worker: Callable[..., None], *args: Any) -> None:
    """``worker``, then leave at once: after FSDP2 on gloo, a rank sometimes aborts in
    interpreter teardown ("terminate called without an active exception", a joinable C++
    thread), after its answer was written. An exception still reaches ``run_ranks``."""
    worker(rank, *args)
    os._exit(0)


def run_ranks(worker: Callable[..., None], out_dir: Path, *args: Any,
              timeout_seconds: float = 240) -> list[dict]:
    context = mp.spawn(_exit_when_done, args=(worker, free_port(), str(out_dir), *args),
                       nprocs=WORLD, join=False)
    # join() raises a rank's exception with its traceback, and returns False while some rank
    # still runs (it returns as each one ends).
    deadline = time.monotonic() + timeout_seconds
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("a rank hung")
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
