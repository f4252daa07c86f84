"""pardec.common.run_records: the machine a measurement ran on, and the named-entry JSON files."""

from __future__ import annotations

import json

from pardec.common import run_records


def test_machine_description_names_the_cpu_model_family_and_cores(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                       "model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 99\nmodel name\t: other\n")
    monkeypatch.setattr(run_records.os, "cpu_count", lambda: 2)
    assert run_records.machine_description(cpuinfo) == "AMD EPYC (family 26, model 2), 2 cores"
    monkeypatch.setattr(run_records.platform, "processor", lambda: "arm")
    assert run_records.machine_description(tmp_path / "missing") == "arm, 2 cores"


def test_set_entry_replaces_one_name_and_keeps_the_others(tmp_path):
    path = tmp_path / "sub" / "times.json"
    run_records.set_entry(path, "a", {"seconds": 1})
    run_records.set_entry(path, "b", {"seconds": 2})
    run_records.set_entry(path, "a", {"seconds": 3})
    assert json.loads(path.read_text()) == {"a": {"seconds": 3}, "b": {"seconds": 2}}
    assert sorted(p.name for p in path.parent.iterdir()) == ["times.json"]  # no temporary file left
