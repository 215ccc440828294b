"""Running a test body on several gloo ranks: ``run_ranks(worker, args)`` spawns them, each
calling ``worker(rank, port, out_dir, *args)`` and writing ``rank{N}.json`` into ``out_dir``;
it returns those answers, fails with a rank's traceback if one raised, and kills ranks
that outlive the deadline (a hang fails the test instead of stalling CI)."""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, port: int) -> None:
    """Join the ranks' gloo group, on one torch thread: ``WORLD`` ranks share the 2 cores CI
    has, and ranks' OpenMP threads competing for them wait on each other at every operation."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)


def answer(out_dir: str, rank: int, result: dict) -> None:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _exit_when_done(rank: int, worker: Callable[..., None], port: int, out_dir: str,
                    *args: Any) -> None:
    """``worker``, then leave at once, the process group still up.

    Tearing the group down from Python can hang a rank: a gloo process group destroyed while
    its worker thread still releases a finished collective (which needs the GIL the destroying
    thread holds) deadlocks in ``~ProcessGroupGloo``'s thread join -- seen after
    ``destroy_process_group()`` with a DDP model freed later, in a third of runs of plain DDP
    once peft is imported. ``os._exit`` ends the process without running any of it; after
    FSDP2 a rank also aborted in interpreter teardown ("terminate called without an active
    exception"). A worker's exception is written beside the answers for ``run_ranks``."""
    try:
        worker(rank, port, out_dir, *args)
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_ranks(worker: Callable[..., None], out_dir: Path, *args: Any,
              timeout_seconds: float = 240) -> list[dict]:
    context = mp.spawn(_exit_when_done, args=(worker, free_port(), str(out_dir), *args),
                       nprocs=WORLD, join=False)
    # join() raises when a rank exits with an error, and returns False while some rank still
    # runs (it returns as each one ends).
    deadline = time.monotonic() + timeout_seconds
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail("a rank hung")
    except mp.ProcessExitedException:
        for process in context.processes:
            process.kill()
        errors = sorted(out_dir.glob("rank*.error"))
        pytest.fail("\n".join(f"{path.stem}:\n{path.read_text()}" for path in errors)
                    or "a rank died without a Python exception")
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
