"""How big ``gradckpt demo`` runs: the default, ``--quick``, and the flags that override them."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

__all__ = ["DemoSize", "DEFAULT_DEMO", "QUICK_DEMO", "demo_size_from"]


@dataclass(frozen=True)
class DemoSize:
    """How big the demo's model, batch and chains are, and how long it trains and times.

    ``layers``..``timing_repeats``: the GPT of part 1. ``depths``: the chain lengths of the
    sqrt(n) table; chains up to ``measured_depth`` blocks are also run and measured. Each chain
    block is an MLP layer of ``chain_width`` on ``chain_rows`` rows.
    """

    layers: int
    batch: int
    seq: int
    steps: int
    timing_repeats: int
    depths: tuple[int, ...]
    measured_depth: int
    chain_width: int
    chain_rows: int


# The default runs in about a minute on a 2-core CPU; --quick is for tests and CI (seconds).
# Chain blocks are narrow and tall (small weights, large activations), so that the sqrt(n)
# table is about activations, not parameter gradients.
DEFAULT_DEMO = DemoSize(
    layers=8, batch=16, seq=128, steps=2, timing_repeats=4,
    depths=(4, 8, 16, 32, 64, 100, 256), measured_depth=16,
    chain_width=128, chain_rows=4096,
)
QUICK_DEMO = DemoSize(
    layers=3, batch=4, seq=64, steps=2, timing_repeats=2,
    depths=(4, 8, 16, 100), measured_depth=8,
    chain_width=64, chain_rows=1024,
)


def demo_size_from(args: argparse.Namespace) -> DemoSize:
    """The preset ``--quick`` picks, with the sizes given as flags put in.

    Example:
        >>> from gradckpt.cli.parser import build_parser
        >>> size = demo_size_from(build_parser().parse_args(["demo", "--quick", "--layers", "5"]))
        >>> size.layers, size.batch == QUICK_DEMO.batch
        (5, True)
    """
    preset = QUICK_DEMO if args.quick else DEFAULT_DEMO
    return dataclasses.replace(
        preset,
        layers=args.layers or preset.layers,
        batch=args.batch or preset.batch,
        seq=args.seq or preset.seq,
        steps=args.steps or preset.steps,
    )
