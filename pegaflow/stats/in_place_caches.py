"""What ``pegaflow-stat`` says of the KV caches an engine's CPU workers moved into shared memory
(``pegaflow/platform/in_place_segments.py``): those of running workers, and those workers
killed since left in /dev/shm, with what removes them."""

from __future__ import annotations

from pegaflow.platform import in_place_segments
from pegaflow.platform.in_place_segments import InPlaceSegment
from pegaflow.platform.values import format_size


def in_place_note(engine_name: str) -> str:
    """Lines (each after a newline) on engine ``engine_name``'s CPU workers' KV caches; ""
    when there are none."""
    found = in_place_segments.find(engine_name)
    running = [s for s in found if s.is_ours and s.is_owner_alive]
    gone = [s for s in found if s.is_orphan]
    foreign = [s for s in found if not s.is_ours]
    lines = []
    if running:
        lines.append(f"cpu kv  {_count(running)} of CPU workers running")
    if gone:
        lines.append(f"cpu kv  {_count(gone)} left by CPU workers that are gone: the engine's next "
                     f"start removes them, so does `pegaflow-engine --clean {engine_name}` while no "
                     f"engine of that name runs")
    if foreign:
        lines.append(f"cpu kv  {len(foreign)} under our name not this user's (another user made them): "
                     + ", ".join(s.name for s in foreign[:3]))
    return "".join("\n" + line for line in lines)


def _count(segments: list[InPlaceSegment]) -> str:
    size = format_size(sum(s.num_bytes for s in segments))
    pids = ", ".join(str(s.pid) for s in segments)
    return f"{len(segments)} KV {'cache' if len(segments) == 1 else 'caches'} in /dev/shm ({size}, pids {pids})"
