"""Where and when a measurement ran: the machine's description, and the small JSON files of named entries
that keep it beside committed results.

Machines of one name differ in speed: on two "AMD EPYC, 2 cores" machines the same conversion ran 1.3x
faster, step for step, on one than on the other (docs/results/real_cpu.md). So a wall time or a TPS
is recorded with :func:`machine_description` (the CPU's model name, family, model and cores) and, for a
benchmark, the accelerator it ran on. The reproduce driver (``pardec.cli.reproduce``) keeps its step and
conversion times, and the benchmarks (``pardec.benchmarks.common.write_results``) their machines, in
files written by :func:`set_entry`: one JSON object, one entry per name, replaced atomically.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def machine_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU, e.g. ``AMD EPYC (family 26, model 2), 2 cores``: ``/proc/cpuinfo``'s first model name,
    family and model, else what :mod:`platform` says, and the machine's cores (``os.cpu_count()``)."""
    fields: dict[str, str] = {}
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return f"{name}, {os.cpu_count()} cores"


def set_entry(path: Path, name: str, entry: dict) -> None:
    """Write ``entry`` under ``name`` in the JSON object at ``path`` (atomically), keeping the other names."""
    entries = json.loads(path.read_text()) if path.is_file() else {}
    entries[name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=2) + "\n")
    tmp.replace(path)
