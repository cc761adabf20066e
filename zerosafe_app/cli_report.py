"""What `zerosafe convert` prints once a run ends: the summary lines, or the JSON."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from zerosafe.units import format_bytes

if TYPE_CHECKING:
    from zerosafe.stages.results import RunSummary

__all__ = ["print_convert_result", "print_summary"]


def print_convert_result(
    output: str, summary: RunSummary, *, via: str, why: str, as_json: bool, quiet: bool
) -> None:
    """Print what a `convert` run did (`via` and `why`: where it ran): the JSON, one line for an output that was already complete, or the summary lines;
    then the run's warnings on stderr."""
    if as_json:
        print(json.dumps({**summary.to_json(), "via": via, "via_reason": why}, indent=1))
    elif summary.status == "already-complete":
        print(
            f"{output}: already a complete conversion of this checkpoint with these options; nothing to do."
        )
    elif not quiet:
        print_summary(output, summary, ran=why)
    if summary.status == "converted" and not as_json:
        for warning in summary.warnings:
            print(f"zerosafe: warning: {warning}", file=sys.stderr)


def print_summary(output: str, summary: RunSummary, *, ran: str) -> None:
    """The few lines a converted run prints (`ran`: where it ran)."""
    stats = summary.stats
    assert stats is not None  # a converted run has its stats
    print(
        f"converted {summary.num_tensors} tensors into {len(summary.files)} file(s) in {output} "
        f"in {summary.seconds:.1f} s ({format_bytes(summary.throughput_bytes_per_second)}/s read; "
        f"peak memory {format_bytes(stats.peak_rss_bytes)})"
    )
    if stats.source_read_ratio:
        print(
            f"  read {format_bytes(stats.source_bytes_read)} from the source: "
            f"{stats.source_read_ratio:.3f} x the {format_bytes(stats.source_bytes_needed)} "
            "it needs (the tensor bytes it copies, plus metadata and headers)"
        )
    print(f"  ran: {ran}")
    if stats.mode_reason:
        print(f"  mode: {stats.mode_reason}")
    for alias, target in summary.aliases.items():
        print(f"  tied: {alias} -> {target} (stored once; recorded in the metadata)")
    for note in summary.notes:
        print(f"  note: {note}")
