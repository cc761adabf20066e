"""Summarize a `py-spy record --idle --threads -f raw` profile of one command (bench/device_command.sh).

    python bench/_profile.py PROFILE.txt [--rate 250] [--top 25]

Prints, in seconds of wall-clock (samples / rate):
- each thread group (threads named alike, numbers dropped) and process: samples;
- the main thread's time inclusive per zerosafe function (each counted once per stack): where
  the command's wall-clock goes, phase by phase;
- the busiest leaves (self time) across every thread, waits included, so a lock or a queue
  that the work waits on shows by name.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_THREAD = re.compile(r"thread \((\d+)\)(?::\s*(.*))?")
_FRAME = re.compile(r"(.*) \((.*?)(?::\d+)?\)$")
_OURS = ("zerosafe/", "zerosafe_app/")


def parse(path: str) -> list[tuple[str, str, list[str], int]]:
    """[(process, thread name, frames root first, samples)]."""
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            parts = stack.split(";")
            process, thread, frames = parts[0], "?", parts[1:]
            if frames and (m := _THREAD.match(frames[0])):
                thread = re.sub(r"[_-]?\d+$", "", m.group(2) or "unnamed")
                frames = frames[1:]
            rows.append((process.split('"')[0].strip(), thread, frames, int(count)))
    return rows


def summarize(path: str, rate: float, top: int) -> str:
    rows = parse(path)
    out = []
    threads: Counter[tuple[str, str]] = Counter()
    for process, thread, _, n in rows:
        threads[process, thread] += n
    out.append("samples by thread group (s):")
    for (process, thread), n in threads.most_common(top):
        out.append(f"  {n / rate:7.2f}  {process} {thread}")
    main_pid = rows[0][0] if rows else ""
    inclusive: Counter[str] = Counter()
    main_total = 0
    for process, thread, frames, n in rows:
        if process != main_pid or thread != "MainThread":
            continue
        main_total += n
        seen = set()
        for frame in frames:
            m = _FRAME.match(frame)
            if m and any(o in m.group(2) for o in _OURS) and m.group(1) not in seen:
                seen.add(m.group(1))
                inclusive[m.group(1)] += n
    out.append(f"main thread, {main_total / rate:.2f} s; inclusive per zerosafe function (s):")
    for name, n in inclusive.most_common(top):
        out.append(f"  {n / rate:7.2f}  {name}")
    leaves: Counter[str] = Counter()
    for _, thread, frames, n in rows:
        if frames:
            leaves[f"{thread}: {frames[-1]}"] += n
    out.append("leaves, every thread (s):")
    for name, n in leaves.most_common(top):
        out.append(f"  {n / rate:7.2f}  {name[:150]}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile")
    p.add_argument("--rate", type=float, default=250.0, help="py-spy's -r (samples/s)")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    print(summarize(args.profile, args.rate, args.top))


if __name__ == "__main__":
    main()
