"""Helpers shared by the benchmark scripts in ``bench/``: timing, memory, machine load, tables.

The rules they implement (docs/planning.md, "What `profile` measures"):

- Time is quoted as ratios measured side by side in one process, round after round; each round
  gives one ratio per contender. The median over rounds is the result; quartiles, min and max
  show the spread. Two schemes:

  ``alternate_timings`` (few contenders): warm-up rounds, then one step of each contender per
  round, the order rotating (A B C, B C A, C A B, ...).

  ``bracketed_timings`` (many contenders, ratios to one reference): per round, each contender
  runs a block of back-to-back steps between two blocks of the reference, the contenders in a
  seeded random order: reference, c3, reference, c1, reference, c2, reference. The first steps
  of every block are untimed, so that each timed step follows a step of its own contender, as
  in a training loop: a step's time depends on the step before it (on a 2-core CPU, a plain
  step right after one of torch's selective checkpointing took 10-15% longer than after another
  plain step). The ratio compares the contender's block with the mean of the two reference
  blocks around it, which cancels a machine that speeds up or slows down over seconds (these
  machines drift by 10-20% over a few seconds).
- Memory is a measured peak, never a guess: ``torch.cuda.max_memory_allocated()`` on CUDA,
  ``MemTracker``'s "peak" snapshot ("Total") on CPU. MemTracker slows every operation down, so
  memory is measured in its own runs, never while timing.
- Two processes measuring at once on a 2-core machine make every timing meaningless, so
  ``ForeignLoad`` measures how much CPU the rest of the machine used during each round (each
  block, for ``bracketed_timings``); what ran while other processes were busy is discarded and
  run again.
- Python's garbage collector: ``bracketed_timings`` collects before each block, with the objects
  made before timing frozen (``gc.freeze``), so that a full collection (0.2 s with torch loaded)
  never lands inside a timed step.

Nothing here imports gradckpt: the scripts measure the library from the outside.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MIB = 1024 * 1024


def require_identical_gradients(
    model: torch.nn.Module,
    steps: dict[str, Callable[[], torch.Tensor]],
    display: Callable[[str], str] = repr,
) -> int:
    """Run each step once (it returns the loss and leaves the gradients); exit with status 1
    unless every step's loss and parameter gradients equal the first step's, bit for bit.

    Timing contenders that compute different things would be meaningless. ``display`` names a
    step in the message. Returns how many gradient tensors were compared.
    """
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    results = {}
    for label, step in steps.items():
        loss = step()
        results[label] = (loss, [p.grad.detach().clone() for _, p in named])
    reference = next(iter(steps))
    reference_loss, reference_grads = results[reference]
    for label, (loss, grads) in results.items():
        differing = [
            name
            for (name, _), mine, theirs in zip(named, reference_grads, grads, strict=True)
            if not torch.equal(mine, theirs)
        ]
        if differing or not torch.equal(reference_loss, loss):
            raise SystemExit(
                f"FAIL: gradients of {display(label)} differ from {display(reference)} (loss "
                f"{loss.item()!r} vs {reference_loss.item()!r}; {len(differing)} of {len(named)} "
                f"gradient tensors differ, first: {differing[:3]})"
            )
    model.zero_grad(set_to_none=True)
    return len(named)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer read afterwards covers it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Round:
    """One timed round: each contender's step time, and what the rest of the machine did."""

    seconds: dict[str, float]
    foreign_cores: float | None  # CPU other processes used meanwhile (see ForeignLoad)
    disturbed: bool  # foreign_cores above the threshold: the round is not used


@dataclass
class Timings:
    """Every round ``alternate_timings`` ran, and which of them count."""

    rounds: list[Round]
    wanted: int  # how many undisturbed rounds were asked for

    @property
    def used(self) -> list[Round]:
        """The undisturbed rounds; all rounds when every one was disturbed."""
        clean = [r for r in self.rounds if not r.disturbed]
        return clean or self.rounds

    @property
    def reliable(self) -> bool:
        """Whether the wanted number of undisturbed rounds was reached."""
        return sum(1 for r in self.rounds if not r.disturbed) >= self.wanted

    def seconds(self, name: str) -> list[float]:
        """The step times of contender ``name`` over the used rounds."""
        return [r.seconds[name] for r in self.used]


def alternate_timings(
    steps: dict[str, Callable[[], Any]],
    rounds: int,
    warmup_rounds: int,
    device: torch.device,
    on_round: Callable[[int, Round], None] | None = None,
    max_foreign_cores: float = 0.1,
    patience_seconds: float = 900.0,
    log: Callable[[str], None] = print,
) -> Timings:
    """Time each step of ``steps`` once per round, the contenders interleaved.

    ``warmup_rounds`` untimed rounds come first. Round ``r`` runs the contenders in the order of
    ``steps`` rotated by ``r`` places. Before each round we wait (asleep, so as not to disturb
    anyone else's measurement) until other processes use at most ``max_foreign_cores`` cores; a
    round during which they used more anyway is marked disturbed and run again. After
    ``patience_seconds`` of timing we stop waiting and retrying: the result then has fewer
    undisturbed rounds than asked for (``Timings.reliable`` is False). ``max_foreign_cores=inf``
    turns all this off. ``on_round(r, round)`` is called after each timed round.
    """
    names = list(steps)
    for _ in range(warmup_rounds):
        for name in names:
            steps[name]()
    synchronize(device)
    deadline = time.monotonic() + patience_seconds
    timings = Timings([], wanted=rounds)
    clean = 0
    attempt = 0
    while clean < rounds:
        patient = time.monotonic() < deadline
        if not patient and attempt >= rounds:
            break
        if patient:
            wait_for_quiet(max_foreign_cores, deadline, log)
        shift = attempt % len(names)
        this_round: dict[str, float] = {}
        load = ForeignLoad()
        load.start()
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            steps[name]()
            synchronize(device)
            this_round[name] = time.perf_counter() - start
        foreign_cores = load.stop()
        disturbed = foreign_cores is not None and foreign_cores > max_foreign_cores
        measured = Round({name: this_round[name] for name in names}, foreign_cores, disturbed)
        timings.rounds.append(measured)
        clean += not disturbed
        if on_round is not None:
            on_round(attempt, measured)
        attempt += 1
    return timings


@dataclass(frozen=True)
class Block:
    """Back-to-back steps of one contender: untimed warm-up steps, then the timed ones."""

    name: str
    seconds: list[float]  # the timed steps
    foreign_cores: float | None  # CPU other processes used meanwhile (see ForeignLoad)
    disturbed: bool  # foreign_cores above the threshold: the block is not used

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)


@dataclass(frozen=True)
class BracketedRound:
    """One round of ``bracketed_timings``: reference, c, reference, c', ..., reference."""

    blocks: list[Block]

    def ratios(self) -> dict[str, float | None]:
        """Each contender's block time / the mean of the two reference blocks around it.

        None where any of the three blocks was disturbed.
        """
        ratios: dict[str, float | None] = {}
        for index in range(1, len(self.blocks) - 1, 2):
            before, block, after = self.blocks[index - 1 : index + 2]
            if before.disturbed or block.disturbed or after.disturbed:
                ratios[block.name] = None
            else:
                reference = (before.median_seconds + after.median_seconds) / 2
                ratios[block.name] = block.median_seconds / reference
        return ratios


@dataclass
class BracketedTimings:
    """Every round ``bracketed_timings`` ran, and the ratios that count."""

    reference: str
    names: list[str]  # the contenders, in the order given (not the order they ran in)
    wanted: int  # how many undisturbed ratios per contender were asked for
    rounds: list[BracketedRound]

    def ratios_by_round(self, name: str) -> dict[int, float]:
        """Contender ``name``'s undisturbed ratios to the reference, by round index."""
        found = {}
        for index, measured in enumerate(self.rounds):
            ratio = measured.ratios()[name]
            if ratio is not None:
                found[index] = ratio
        return found

    def ratios(self, name: str) -> list[float]:
        """Contender ``name``'s undisturbed ratios to the reference, round after round."""
        return list(self.ratios_by_round(name).values())

    def seconds(self, name: str) -> list[float]:
        """The undisturbed block times (median of a block's timed steps) of ``name``."""
        return [
            block.median_seconds
            for measured in self.rounds
            for block in measured.blocks
            if block.name == name and not block.disturbed
        ]

    @property
    def reliable(self) -> bool:
        """Whether every contender reached the wanted number of undisturbed ratios."""
        return all(len(self.ratios_by_round(name)) >= self.wanted for name in self.names)


def bracketed_timings(
    steps: dict[str, Callable[[], Any]],
    reference: str,
    rounds: int,
    warmup_steps: int,
    timed_steps: int,
    device: torch.device,
    seed: int = 0,
    on_round: Callable[[int, BracketedRound], None] | None = None,
    max_foreign_cores: float = 0.1,
    patience_seconds: float = 900.0,
    log: Callable[[str], None] = print,
) -> BracketedTimings:
    """Time every step of ``steps`` against ``steps[reference]``, each between two blocks of it.

    A round runs a block of the reference, then for each other contender, in an order shuffled
    by ``random.Random(seed)`` afresh each round, a block of it and another of the reference.
    A block is ``warmup_steps`` untimed steps, then ``timed_steps`` timed ones (its time: their
    median). Rounds go on until every contender has ``rounds`` undisturbed ratios (a block during
    which other processes used more than ``max_foreign_cores`` cores is disturbed, and so are the
    ratios it enters); before each round we wait, asleep, for a quiet machine. After
    ``patience_seconds`` we stop waiting, and stop once ``rounds`` rounds ran
    (``BracketedTimings.reliable`` then says whether enough counted). ``on_round(r, round)`` is
    called after each round.
    """
    names = [name for name in steps if name != reference]
    rng = random.Random(seed)
    deadline = time.monotonic() + patience_seconds
    timings = BracketedTimings(reference, names, rounds, [])

    def block(name: str) -> Block:
        gc.collect()  # cheap (the rest is frozen); no collection left pending for the steps
        load = ForeignLoad()
        load.start()
        for _ in range(warmup_steps):
            steps[name]()
        synchronize(device)
        seconds = []
        for _ in range(timed_steps):
            start = time.perf_counter()
            steps[name]()
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        foreign_cores = load.stop()
        disturbed = foreign_cores is not None and foreign_cores > max_foreign_cores
        return Block(name, seconds, foreign_cores, disturbed)

    gc.collect()
    gc.freeze()  # what exists now is never scanned again: collections between blocks stay cheap
    try:
        while not timings.reliable:
            patient = time.monotonic() < deadline
            if not patient and len(timings.rounds) >= rounds:
                break
            if patient:
                wait_for_quiet(max_foreign_cores, deadline, log)
            blocks = [block(reference)]
            for name in rng.sample(names, len(names)):
                blocks += [block(name), block(reference)]
            timings.rounds.append(BracketedRound(blocks))
            if on_round is not None:
                on_round(len(timings.rounds) - 1, timings.rounds[-1])
    finally:
        gc.unfreeze()
    return timings


def wait_for_quiet(
    max_foreign_cores: float, deadline: float, log: Callable[[str], None] = print
) -> bool:
    """Sleep until other processes use at most ``max_foreign_cores`` cores (1 s samples).

    Returns False if ``deadline`` (``time.monotonic()``) came first or the load cannot be read.
    """
    waited_since = None
    while True:
        load = ForeignLoad()
        load.start()
        time.sleep(0.5)
        cores = load.stop()
        if cores is None:
            return False
        if cores <= max_foreign_cores:
            if waited_since is not None:
                log(f"  machine quiet again after {time.monotonic() - waited_since:.0f} s")
            return True
        if waited_since is None:
            waited_since = time.monotonic()
            log(f"  other processes are using {cores:.2f} cores; waiting for them to finish")
        if time.monotonic() >= deadline:
            log("  gave up waiting: out of patience, timing on a busy machine")
            return False
        time.sleep(1.5)


@dataclass(frozen=True)
class RatioStats:
    """Per-round ratios ``numerator / denominator``, summarized.

    ``lower_quartile`` .. ``upper_quartile`` hold the middle half of the rounds: a better picture
    of the noise than ``low`` .. ``high``, which one stray round sets.
    """

    median: float
    lower_quartile: float
    upper_quartile: float
    low: float
    high: float
    rounds: int


def ratio_stats(numerator: Sequence[float], denominator: Sequence[float]) -> RatioStats:
    """Median, quartiles, min and max of the round-by-round ratios of two lists of times."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("need two equally long, non-empty lists of times")
    return summarize_ratios([a / b for a, b in zip(numerator, denominator, strict=True)])


def summarize_ratios(ratios: Sequence[float]) -> RatioStats:
    """Median, quartiles, min and max of per-round ratios."""
    if not ratios:
        raise ValueError("no ratios to summarize")
    if len(ratios) > 1:
        lower_quartile, _, upper_quartile = statistics.quantiles(ratios, n=4, method="inclusive")
    else:
        lower_quartile = upper_quartile = ratios[0]
    return RatioStats(
        statistics.median(ratios),
        lower_quartile,
        upper_quartile,
        min(ratios),
        max(ratios),
        len(ratios),
    )


class ForeignLoad:
    """How many cores' worth of CPU time *other* processes used between ``start()`` and ``stop()``.

    Busy time of the whole machine (``/proc/stat``) minus this process's own (``/proc/self/stat``,
    all threads), less two clock ticks of rounding slack. Anything above ~0.1 core on a 2-core
    machine means the timings were disturbed. The kernel counts in ticks (10 ms), so intervals
    under ``MIN_SECONDS`` cannot be judged: ``stop()`` returns None for them, as it does where
    ``/proc`` is missing (not Linux).
    """

    MIN_SECONDS = 0.25

    def start(self) -> None:
        self._begin = (_machine_busy_seconds(), _own_cpu_seconds(), time.perf_counter())

    def stop(self) -> float | None:
        machine_begin, own_begin, wall_begin = self._begin
        machine_end, own_end = _machine_busy_seconds(), _own_cpu_seconds()
        if None in (machine_begin, own_begin, machine_end, own_end):
            return None
        wall = time.perf_counter() - wall_begin
        if wall < self.MIN_SECONDS:
            return None
        foreign = (machine_end - machine_begin) - (own_end - own_begin) - 2 / _ticks_per_second()
        return max(foreign, 0.0) / wall


def _ticks_per_second() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100


def _machine_busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    busy = sum(fields[:8]) - idle
    return busy / _ticks_per_second()


def _own_cpu_seconds() -> float | None:
    try:
        with open("/proc/self/stat") as stat:
            # fields after the ")" that ends the command name; utime and stime are 14 and 15
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _ticks_per_second()


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages, or "n/a"."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [row[0].ljust(widths[0])]
        parts += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


# Help for the flags ``add_run_arguments`` makes from a script's FULL/QUICK keys.
RUN_ARGUMENT_HELP = {
    "layers": "transformer blocks",
    "batch": "batch size",
    "seq": "sequence length",
    "embd": "model width (n_embd)",
    "heads": "attention heads",
    "rounds": "timed rounds",
    "warmup": "untimed rounds before them",
    "patience": "seconds to wait for a quiet machine before giving up",
}
NON_NEGATIVE = ("warmup", "patience")  # every other sized flag must be positive


FREED_MEMORY_KEPT = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "68719476736",
    "MALLOC_TOP_PAD_": "1073741824",
}


def keep_freed_memory() -> None:
    """Restart this script with glibc keeping freed memory, unless the environment says how.

    A plain step's activations are the largest allocations a training step makes; glibc's
    default malloc hands such blocks back to the OS when they are freed and the next step pays
    page faults to touch them again (about 23,000 per plain step of the frontier's model, 3,400
    with every layer checkpointed). That makes checkpointed steps look nearly free on CPU, while
    CUDA's caching allocator keeps freed memory and pays nothing. These variables make glibc keep
    it too. They are read when the process starts, hence the restart (``os.execve``); setting
    any ``MALLOC_MMAP_MAX_`` yourself (even to glibc's default) skips it.
    """
    if "MALLOC_MMAP_MAX_" in os.environ:
        return
    environment = {**os.environ, **FREED_MEMORY_KEPT}
    os.execve(sys.executable, [sys.executable, *sys.argv], environment)


def describe_malloc() -> str:
    """One line for a benchmark's header: whether freed memory is kept (see keep_freed_memory)."""
    settings = {name: os.environ.get(name) for name in FREED_MEMORY_KEPT}
    given = " ".join(f"{name}={value}" for name, value in settings.items() if value is not None)
    if settings == FREED_MEMORY_KEPT:
        return f"malloc: freed memory kept ({given})"
    return f"malloc: {given or 'glibc defaults'}, not the settings keep_freed_memory() makes"


def add_run_arguments(
    parser: argparse.ArgumentParser,
    full: dict[str, float],
    quick: dict[str, float],
    help_texts: dict[str, str] | None = None,
) -> None:
    """The flags every benchmark script has: one per key of ``full`` (sizes, rounds, ...),
    defaulting to ``full``'s value or, with ``--quick``, to ``quick``'s; ``--seed``,
    ``--max-foreign-load`` and ``--quick``. ``parse_run_arguments`` fills in the defaults.

    ``help_texts`` overrides ``RUN_ARGUMENT_HELP`` per key; each help ends with
    "[full / quick]".
    """
    help_texts = {**RUN_ARGUMENT_HELP, **(help_texts or {})}
    for key, value in full.items():
        parser.add_argument(
            f"--{key}",
            type=type(value),
            default=None,
            help=f"{help_texts[key]} [{value} / {quick[key]}]",
        )
    parser.add_argument("--seed", type=int, default=0, help="[0]")
    parser.add_argument(
        "--max-foreign-load",
        type=float,
        default=0.1,
        metavar="CORES",
        help="wait before, and rerun, rounds in which other processes use more CPU than this "
        "(inf: never) [0.1]",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, few rounds: a smoke test of seconds"
    )


def parse_run_arguments(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    full: dict[str, float],
    quick: dict[str, float],
) -> argparse.Namespace:
    """Parse ``argv``; sized flags not given take ``full``'s or (``--quick``) ``quick``'s value."""
    args = parser.parse_args(argv)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    positive = [key for key in full if key not in NON_NEGATIVE]
    if any(getattr(args, key) < 1 for key in positive):
        parser.error(f"{', '.join('--' + key for key in positive)} must be positive")
    non_negative = [key for key in NON_NEGATIVE if key in full]
    if any(getattr(args, key) < 0 for key in non_negative):
        parser.error(f"{' and '.join('--' + key for key in non_negative)} cannot be negative")
    return args


def add_device_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """``--device``: cpu, cuda, cuda:N or auto (cuda when torch sees a GPU)."""
    parser.add_argument(
        "--device", default=default, help=f"cpu, cuda, cuda:N or auto [{default}]"
    )


def resolve_device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    """The device ``--device`` names ("auto": cuda when available), with its index filled in;
    a parser error when it names a GPU that torch does not see."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {name}: torch sees no CUDA GPU")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def describe_machine(device: torch.device) -> str:
    """One line: torch version, device, CPU threads torch uses and, on CPU, malloc's settings."""
    text = f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} CPU threads"
    if device.type == "cuda":
        text += f", {torch.cuda.get_device_name(device)}"
    else:
        text += f"; {describe_malloc()}"
    return text
