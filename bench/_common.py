"""What the benchmark scripts in ``bench/`` share: timing on a shared machine, profiling on a
quiet one, memory, machine load, tables and flags. No script imports another.

Plans are measured side by side with the package's own protocol (``gradckpt.side_by_side``:
docs/planning.md, "What `profile` measures"): time as ratios measured in one process, round
after round, the median over rounds the result and quartiles, min and max the spread; memory
as the measured peak of the step users write (``torch.cuda.max_memory_allocated()`` on CUDA,
``MemTracker``'s "Total" on CPU), in runs of its own, never while timing. What benchmarks add
here is the machine around them:

- Two processes measuring at once on a 2-core machine make every timing meaningless, so
  ``timed_side_by_side`` watches how much CPU the rest of the machine uses during each turn
  (``ForeignLoad``): what ran while other processes were busy is discarded and run again, and
  before each round it waits, asleep, for a quiet machine (``wait_for_quiet``), for at most
  ``--patience`` seconds over the run. ``quiet_profile`` takes ``gradckpt.profile`` the same way.
- On CPU the scripts restart themselves with glibc keeping freed memory, as CUDA's caching
  allocator does (``keep_freed_memory``).
- Every script has the same flags for sizes, rounds, seeds and patience (``add_run_arguments``)
  and prints the command, the machine and its load in its header; the models built from those
  flags are TinyGPT (``GPTRun``) and a Transformers Llama (``LlamaRun``).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import gradckpt
from gradckpt.cli.progress import progress_bar
from gradckpt.plan import Segment
from gradckpt.side_by_side import (
    Contender,
    GradientCheck,
    RatioStats,
    SideBySideTimes,
    compare_gradients,
    installed,
    time_side_by_side,
)
from gradckpt.toy_models import GPTConfig, TinyGPT

MIB = 1024 * 1024


def mib(nbytes: int) -> str:
    """Bytes as MiB with two decimals, as the tables print them."""
    return f"{nbytes / MIB:.2f}"


def require_identical_gradients(
    model: torch.nn.Module,
    steps: Mapping[str, Callable[[], torch.Tensor]],
    display: Callable[[str], str] = repr,
) -> int:
    """Run each step once (it returns the loss and leaves the gradients); exit with status 1
    unless every step's loss and parameter gradients equal the first step's, bit for bit
    (``gradckpt.side_by_side.compare_gradients``).

    Timing contenders that compute different things would be meaningless. ``display`` names a
    step in the message. Returns how many gradient tensors were compared.
    """
    return require_same_gradients(model, steps, display=display).compared


# A plan that computes the loss in chunks (``plan.head_chunks > 1``) sums it in another order:
# its loss and gradients match the plain model's within float rounding, not bit for bit
# (largest measured 3.2e-7 relative, tests/engine/test_engine_chunked_head.py).
CHUNKED_LOSS_ROUNDING = 1e-5


def require_same_gradients(
    model: torch.nn.Module,
    steps: Mapping[str, Callable[[], torch.Tensor]],
    rounding: Mapping[str, float] | None = None,
    display: Callable[[str], str] = repr,
) -> GradientCheck:
    """``require_identical_gradients``, except that the steps ``rounding`` names may differ
    from the first step by float rounding: each of their tensors (the loss, every gradient)
    within that much of the reference tensor's largest magnitude
    (``GradientCheck.largest_difference``). Returns the check, to say which matched how.
    """
    rounding = rounding or {}
    check = compare_gradients(model, steps)
    for label, differing in check.differing.items():
        if differing and check.largest_difference[label] > rounding.get(label, -1.0):
            tensors = [name for name in differing if name != "loss"]
            allowed = f", allowed {rounding[label]:.0e}" if label in rounding else ""
            raise SystemExit(
                f"FAIL: gradients of {display(label)} differ from {display(check.reference)} "
                f"({'the loss too; ' if 'loss' in differing else ''}{len(tensors)} of "
                f"{check.compared} gradient tensors differ, first: {tensors[:3]}; largest "
                f"relative difference {check.largest_difference[label]:.1e}{allowed})"
            )
    return check


def with_installed(
    model: torch.nn.Module, step: Callable[[], Any], contender: Contender
) -> Callable[[], Any]:
    """``step`` run with ``contender`` in effect on ``model`` (``side_by_side.installed``), for
    checks that run each contender once."""

    def run() -> Any:
        with installed(model, contender):
            return step()

    return run


def timed_side_by_side(
    steps: Mapping[str, Callable[[], Any]],
    rounds: int,
    *,
    max_foreign_cores: float,
    patience_seconds: float,
    log: Callable[[str], None] = print,
    **options: Any,
) -> SideBySideTimes:
    """``gradckpt.side_by_side.time_side_by_side`` on a shared machine.

    Before each round it waits, asleep (so as not to disturb anyone else's measurement), until
    other processes use at most ``max_foreign_cores`` cores; a turn during which they used more
    is disturbed, and rounds go on until every contender has ``rounds`` undisturbed ratios.
    After ``patience_seconds`` it stops waiting and stops once ``rounds`` rounds ran (the
    result's ``reliable`` then says whether enough counted). ``max_foreign_cores=inf`` turns
    all this off. ``options`` go to ``time_side_by_side`` (the order, turns, warm-up, ...).
    """
    deadline = time.monotonic() + patience_seconds
    watching = max_foreign_cores != math.inf

    def before_round() -> None:
        if watching and time.monotonic() < deadline:
            wait_for_quiet(max_foreign_cores, deadline, log)

    def watch() -> Callable[[], float | None]:
        load = ForeignLoad()
        load.start()
        return load.stop

    return time_side_by_side(
        steps, rounds, watch=watch if watching else None, max_load=max_foreign_cores,
        before_round=before_round, retry_seconds=patience_seconds, **options,
    )


def ratios_or_all(
    times: SideBySideTimes, name: str, against: str | None = None
) -> tuple[list[float], bool]:
    """``name``'s time / ``against``'s (default: the reference) over the undisturbed rounds; if
    none was undisturbed (a busy machine, out of patience), over every round, flagged True."""
    ratios = times.ratios(name, against)
    if ratios:
        return ratios, False
    return list(times.ratios_by_round(name, against, include_disturbed=True).values()), True


def noise_floor(do_nothing: RatioStats) -> float:
    """How far from 1 a do-nothing contender's ratio strayed in the middle half of the rounds.

    Its true ratio is exactly 1 (it runs what the reference runs), so this is what timing alone
    does to any ratio here, offset and spread together: an extra time within the floor is
    noise-sized.
    """
    return max(abs(do_nothing.lower_quartile - 1), abs(do_nothing.upper_quartile - 1))


@dataclass
class QuietProfile:
    """``gradckpt.profile``'s result, and what other processes did meanwhile."""

    profile: gradckpt.Profile
    foreign_cores: float | None  # cores other processes used while it ran (None: unknown)
    disturbed: bool  # they used more than allowed: its times are suspect

    @property
    def foreign(self) -> str:
        """The foreign load as the scripts print it: "0.03", or "n/a"."""
        return "n/a" if self.foreign_cores is None else f"{self.foreign_cores:.2f}"


def quiet_profile(
    model: torch.nn.Module,
    sample: Any,
    *,
    max_foreign_cores: float,
    deadline: float,
    attempts: int = 1,
    report: Callable[[str], None] | None = print,
    **profile_options: Any,
) -> QuietProfile:
    """``gradckpt.profile`` on a quiet machine, and how quiet it stayed.

    Every predicted extra time rests on the profile's times, and a 2-core machine shared with
    one busy process can slow single steps tenfold, so it waits first (until ``deadline``,
    ``time.monotonic()``, at the latest), and a profile taken while others ran is taken again,
    while the deadline allows, at most ``attempts`` times; the last one is kept, marked
    disturbed. ``report``: where a line saying what was measured goes (None: nowhere).
    """
    for _ in range(attempts):
        if max_foreign_cores != math.inf and time.monotonic() < deadline:
            wait_for_quiet(max_foreign_cores, deadline)
        load = ForeignLoad()
        load.start()
        # The progress bar only helps on a terminal; piped into a file it is noise.
        with progress_bar("gradckpt: profiling", enabled=sys.stderr.isatty()) as progress:
            measured = gradckpt.profile(model, sample, progress=progress, **profile_options)
        cores = load.stop()
        disturbed = cores is not None and cores > max_foreign_cores
        if not disturbed or time.monotonic() >= deadline:
            break
    quiet = QuietProfile(measured, cores, disturbed)
    if report is not None:
        report(
            f"gradckpt.profile: peak {mib(measured.peak_bytes)} MiB, fixed "
            f"{mib(measured.fixed_bytes)} MiB, plain step {measured.step_seconds:.3f} s; "
            f"foreign load meanwhile {quiet.foreign}"
        )
        if disturbed:
            report("WARNING: other processes ran while profiling; predicted times are suspect.")
    return quiet


def describe_segments(segments: list[Segment]) -> str:
    """Segments in short: "0-1 2-3" (block ranges), "(4-7: 4-5)" nesting, "+m" save-matmuls,
    "+ops(n)" a ``"save-ops:..."`` policy keeping the outputs of n operations, "+off(n)" an
    ``"offload-ops:..."`` one offloading them (the plan's table, ``str(plan)``, names them).

    Example:
        >>> describe_segments([Segment(0, 1), Segment(2, 2, policy="save-matmuls"),
        ...                    Segment(3, 3, policy="save-ops:aten.mm,aten.silu")])
        '0-1 2+m 3+ops(2)'
    """
    if not segments:
        return "no checkpointing"

    def one(segment: Segment) -> str:
        text = str(segment.start)
        if segment.end > segment.start:
            text += f"-{segment.end}"
        if segment.policy == "save-matmuls":
            text += "+m"
        elif segment.policy and segment.policy.startswith(("save-ops:", "offload-ops:")):
            kind = "ops" if segment.policy.startswith("save-ops:") else "off"
            text += f"+{kind}({len(segment.policy.split(':', 1)[1].split(','))})"
        elif segment.policy:
            text += f"+{segment.policy}"
        if segment.children:
            text = f"({text}: {' '.join(one(child) for child in segment.children)})"
        return text

    return " ".join(one(segment) for segment in segments)


def describe_layout(segments: list[Segment], head_chunks: int = 1) -> str:
    """``describe_segments``, then "; head/k" where the output head and its loss run in k
    chunks of tokens (``Plan.head_chunks``).

    Example:
        >>> describe_layout([Segment(0, 1)], 8), describe_layout([], 1)
        ('0-1; head/8', 'no checkpointing')
    """
    text = describe_segments(segments)
    return f"{text}; head/{head_chunks}" if head_chunks > 1 else text


@dataclass
class GPTRun:
    """The TinyGPT a benchmark runs (``--layers``, ``--embd``, ``--heads``, ``--seq``), seeded
    by ``--seed``, in training mode (dropout on: RNG replay exercised), and its batch of
    ``--batch`` next-token sequences: ``idx`` and ``targets``."""

    model: TinyGPT
    sample: dict[str, torch.Tensor]
    description: str  # one line for the header

    @classmethod
    def from_args(cls, args: argparse.Namespace, device: torch.device) -> GPTRun:
        torch.manual_seed(args.seed)
        config = GPTConfig(n_layer=args.layers, n_embd=args.embd, n_head=args.heads,
                           block_size=args.seq)
        model = TinyGPT(config).to(device).train()
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), device=device)
        sample = {"idx": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
        parameter_count = sum(p.numel() for p in model.parameters())
        description = (
            f"model: TinyGPT {args.layers} layers, n_embd {args.embd}, {args.heads} heads, "
            f"dropout {config.dropout}, {parameter_count / 1e6:.2f}M parameters; "
            f"batch {args.batch} x seq {args.seq}"
        )
        return cls(model, sample, description)


@dataclass
class LlamaRun:
    """The Transformers Llama a benchmark runs, random weights (nothing downloaded), seeded by
    ``--seed``, in training mode with its caches off (as fine-tuning scripts set them), SDPA
    attention, fp32; and its batch ``{"input_ids": ids, "labels": ids}`` of ``--batch`` x
    ``--seq`` tokens.

    Sizes from the flags: ``--layers``, hidden ``--embd``, ``--heads`` (key/value heads: half),
    ``--vocab``; the MLP's width as Llama's configs make it, 8/3 of the hidden size rounded up
    to a multiple of 16 (688 for 256). Attention dropout stays at the config's 0.0, as Llama
    is trained. Built with ``gradckpt.integrations.hf_families.hf_model``.
    """

    model: torch.nn.Module
    sample: dict[str, torch.Tensor]
    description: str  # one line for the header

    @classmethod
    def from_args(cls, args: argparse.Namespace, device: torch.device) -> LlamaRun:
        from gradckpt.integrations.hf import turn_caches_off
        from gradckpt.integrations.hf_families import causal_batch, hf_model

        intermediate = 16 * math.ceil(8 * args.embd / 3 / 16)
        torch.manual_seed(args.seed)
        model = hf_model(
            "llama", hidden_size=args.embd, intermediate_size=intermediate,
            num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=max(args.heads // 2, 1), vocab_size=args.vocab,
            max_position_embeddings=max(args.seq, 2048), attention_dropout=0.0,
            attn_implementation="sdpa",
        ).to(device).train()
        turn_caches_off(model)
        batch = causal_batch(args.batch, args.seq, args.vocab, seed=args.seed + 1)
        sample = {name: tensor.to(device) for name, tensor in batch.items()}
        count = sum(p.numel() for p in model.parameters())
        description = (
            f"model: transformers.LlamaForCausalLM {args.layers} layers, hidden {args.embd}, "
            f"MLP {intermediate}, {args.heads} heads ({model.config.num_key_value_heads} "
            f"key/value), vocab {args.vocab}, attention "
            f"{model.config._attn_implementation}, fp32, {count / 1e6:.2f}M parameters; batch "
            f"{args.batch} x seq {args.seq}, labels = input_ids"
        )
        return cls(model, sample, description)


def command_line(argv: list[str] | None) -> str:
    """The command as typed from the repository root (interpreter path relative when inside)."""
    python = sys.executable
    relative = os.path.relpath(python)
    if not relative.startswith(".."):
        python = relative
    return shlex.join([python, sys.argv[0], *(sys.argv[1:] if argv is None else argv)])


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
    """Parse ``argv``; sized flags not given take ``full``'s or (``--quick``) ``quick``'s value,
    and ``--device`` (``add_device_argument``) becomes a ``torch.device``."""
    args = parser.parse_args(argv)
    if isinstance(getattr(args, "device", None), str):
        args.device = resolve_device(parser, args.device)
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
