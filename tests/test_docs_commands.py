"""Every command in the README and docs/ resolves, without running the heavy work (the lines of ```bash
blocks, and inline code spans that start with ``python``, ``torchrun``, ``pardec-*``, ``bash scripts/`` or
``sbatch``):
``python -m X`` / ``torchrun -m X`` / ``pardec-launch -m X`` name an importable module (and, for a
pardec module with an argparse parser, only ``--flags`` its source defines); ``pardec-*`` commands are
entry points of pyproject.toml; ``bash``/``sbatch``/``source`` scripts and repository paths a command
reads (``scripts/...``, ``benchmarks/results/...``, ``tests/...``) exist; Hydra group overrides
(``experiment=``, ``decoder=``, ``recipe=``, ``model=``, ``data=``, ``deepspeed=``, ``logging=``) name a
YAML file in ``pardec/recipes/<group>/``; ``pip install .[extra]`` names a defined extra. Placeholders
(``<...>``) are not checked. Two commands really start: ``pardec-train --help`` and
``python -m pardec.cli.validate --help``."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "pardec" / "recipes"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ENTRY_POINTS = PYPROJECT["project"]["scripts"]  # name -> "module:function"
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
REPO_PATHS = ("scripts/", "benchmarks/", "pardec/", "tests/", "docs/", ".ci/")
WRITTEN = {"--out"}  # flags whose value a command writes, so it need not exist yet
FENCE = re.compile(r"^\s*```(\S*)\s*$")
FENCED_BLOCK = re.compile(r"^\s*```.*?^\s*```\s*$", re.MULTILINE | re.DOTALL)
INLINE_COMMAND = re.compile(r"`((?:\.venv/bin/)?(?:python3?|torchrun|pardec-[a-z]+|bash scripts/|sbatch )[^`]*)`")
OVERRIDE = re.compile(r"^\+{0,2}([a-z_]+)=(.*)$")
PYTHON = re.compile(r"^python(3(\.\d+)?)?$")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
PREFIXES = {"time", "eval", "exec", "source", "sudo"}


def bash_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command line) for each line of the ```bash blocks in ``text``; a line ending
    in a backslash continues on the next."""
    out, lang, pending, start = [], None, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            lang = None if lang is not None else fence.group(1)
            continue
        if lang != "bash":
            continue
        if not pending:
            start = number
        pending = f"{pending} {line.strip()}".strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        if pending:
            out.append((start, pending))
        pending = ""
    return out


def inline_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) for each inline code span outside fenced blocks that starts like a
    command; a span wrapped over lines is joined."""
    blanked = FENCED_BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return [(blanked.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in INLINE_COMMAND.finditer(blanked)]


def simple_commands(line: str) -> list[list[str]]:
    """The token lists of the simple commands on a shell line: split at ``&&``, ``||``, ``;`` and
    ``|``; a ``$(...)`` substitution is a command of its own; leading ``VAR=value`` assignments and
    ``time``/``eval``/``exec``/``source``/``sudo`` are dropped (``source`` keeps its file)."""
    tokens = shlex.split(line, comments=True)
    commands, current = [], []
    for token in tokens:
        for inner in re.findall(r"\$\(([^)]*)\)", token):
            commands += simple_commands(inner)
        if token in {"&&", "||", ";", "|"}:
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    out = []
    for command in commands:
        while command and (ENV_ASSIGNMENT.match(command[0]) or command[0] in PREFIXES - {"source"}):
            command = command[1:]
        if command and command[0] == "source":
            command = ["bash", *command[1:]]
        if command and not command[0].startswith("$("):
            out.append(command)
    return out


# The helpers that add flags shared by several benchmarks, and the module each lives in.
SHARED_HELPERS = {helper: "pardec.benchmarks.common"
                  for helper in ("add_runtime_args", "add_bound_args", "add_split_arg", "add_template_arg")}
SHARED_HELPERS["add_chunk_args"] = "pardec.benchmarks.chunks"


def argparse_flags(module: str) -> set[str] | None:
    """The ``--flags`` a pardec module's argparse parser defines (string constants of its source, and of the
    module of each :data:`SHARED_HELPERS` helper it calls), or None when the module has no argparse parser
    (Hydra entry points, torchrun)."""
    spec = importlib.util.find_spec(module)
    source = Path(spec.origin).read_text()
    shared = {home for helper, home in SHARED_HELPERS.items() if home != module and f"{helper}(" in source}
    if "add_argument(" not in source and not shared:
        return None
    flags = {node.value for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("--")}
    for home in shared:
        flags |= argparse_flags(home)
    return flags


def module_problems(module: str, args: list[str]) -> list[str]:
    if importlib.util.find_spec(module) is None:
        return [f"module {module!r} does not exist"]
    if not module.startswith("pardec."):
        return []
    flags = argparse_flags(module)
    if flags is None:
        return []
    unknown = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in flags | {"--help"}]
    return [f"{module} has no option {flag}" for flag in unknown]


def invoked_module(command: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) that a command runs: ``python -m X``, ``torchrun ... -m X``,
    ``pardec-launch ... -m X`` or a ``pardec-*`` entry point; None for other programs."""
    program = Path(command[0]).name
    if PYTHON.match(program) or program in {"torchrun", "pardec-launch"}:
        if "-m" in command[:-1]:
            i = command.index("-m")
            return command[i + 1], command[i + 2:]
        return None
    if program in ENTRY_POINTS:
        return ENTRY_POINTS[program].split(":")[0], command[1:]
    return None


def command_problems(command: list[str]) -> list[str]:
    """What does not resolve in one simple command (empty when everything does)."""
    problems = []
    program = Path(command[0]).name
    if program.startswith("pardec-") and program not in ENTRY_POINTS:
        problems.append(f"{program} is not an entry point of pyproject.toml (there: {sorted(ENTRY_POINTS)})")
    invoked = invoked_module(command)
    if invoked is not None:
        problems += module_problems(*invoked)
    for previous, token in zip([None, *command], command):
        if "<" in token:  # a placeholder
            continue
        override = OVERRIDE.match(token)
        if override and (RECIPES / override.group(1)).is_dir() and override.group(2) != "null":
            group, option = override.groups()
            if not (RECIPES / group / f"{option}.yaml").is_file():
                options = sorted(p.stem for p in (RECIPES / group).glob("*.yaml"))
                problems.append(f"{group}={option}: no pardec/recipes/{group}/{option}.yaml (options: {options})")
        for value in {token, token.split("=", 1)[-1]}:
            path = value.split("::")[0]
            if path.startswith(REPO_PATHS) and previous not in WRITTEN and not (ROOT / path).exists():
                problems.append(f"{path} does not exist")
        extras = re.fullmatch(r"\.\[([\w,-]+)\]", token)
        if program in {"pip", "pip3"} and extras:
            problems += [f"pyproject.toml has no extra {e!r}" for e in extras.group(1).split(",") if e not in EXTRAS]
    return problems


def doc_problems(path: Path) -> list[str]:
    problems = []
    text = path.read_text()
    for number, line in bash_commands(text) + inline_commands(text):
        where = f"{path.relative_to(ROOT)}:{number}: {line}"
        try:
            commands = simple_commands(line)
        except ValueError as err:
            problems.append(f"{where}\n    does not parse as a shell line: {err}")
            continue
        problems += [f"{where}\n    {p}" for c in commands for p in command_problems(c)]
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_documented_command_resolves(doc):
    problems = doc_problems(doc)
    assert not problems, "\n".join(problems)


def test_readme_install_block_is_what_ci_runs():
    """The README's Install block and .ci/run run the same two commands, in order."""
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install"):]
    install = install[:install.index("\n## ", 1)]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd ", "export "))]
    assert [line for _, line in bash_commands(install)] and \
        [" ".join(c) for _, line in bash_commands(install) for c in simple_commands(line)] == \
        [" ".join(c) for line in ci for c in simple_commands(line)]


def test_the_readme_commands_are_found():
    """The extraction sees the README's set-up, conversion and Slurm commands, continuation lines joined."""
    lines = [line for _, line in bash_commands((ROOT / "README.md").read_text())]
    assert any(line.startswith("bash scripts/setup.sh ") for line in lines)
    assert any(line.startswith("torchrun --nproc_per_node 8 -m pardec.cli.train") and "deepspeed=zero3" in line
               for line in lines)
    assert any(line.startswith("sbatch --nodes 4 scripts/slurm/train.sbatch") for line in lines)


def test_inline_commands_are_found_outside_fenced_blocks():
    text = ("Run `python -m pardec.benchmarks.cover --mdm x\n  --threads 1` (or `pardec_flex`).\n"
            "```bash\necho `python -m fenced`\n```\nthen `sbatch scripts/slurm/train.sbatch`.\n")
    assert inline_commands(text) == [(1, "python -m pardec.benchmarks.cover --mdm x --threads 1"),
                                     (6, "sbatch scripts/slurm/train.sbatch")]


@pytest.mark.parametrize("line, expected", [
    ("python -m pardec.cli.trian experiment=idlm_default", "module 'pardec.cli.trian' does not exist"),
    (".venv/bin/python -m pardec.benchmarks.idlm_isd --base x --bogus 1",
     "pardec.benchmarks.idlm_isd has no option --bogus"),
    ("pardec-trian recipe=idlm", "pardec-trian is not an entry point"),
    ("pardec-train decoder=isd", "decoder=isd: no pardec/recipes/decoder/isd.yaml"),
    ("torchrun --nproc_per_node 2 -m pardec.cli.train experiment=idlm_defualt", "experiment=idlm_defualt: no"),
    ("pardec-launch --nproc_per_node 8 -m pardec.cli.validat checkpoint=x", "module 'pardec.cli.validat'"),
    ("sbatch scripts/slurm/trian.sbatch recipe=ar", "scripts/slurm/trian.sbatch does not exist"),
    ('eval "$(bash scripts/slurm/local_clustr.sh env /tmp/x)"', "scripts/slurm/local_clustr.sh does not exist"),
    ("python -m pardec.benchmarks.mask_backends --flex-choice benchmarks/results/nope.json",
     "benchmarks/results/nope.json does not exist"),
    ('.venv/bin/pip install -e ".[gpus]"', "pyproject.toml has no extra 'gpus'"),
])
def test_a_broken_command_is_reported(line, expected):
    problems = [p for c in simple_commands(line) for p in command_problems(c)]
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("line", [
    "python -m pardec.cli.train experiment=<x> model=hf model.path=<local HF checkpoint> data=<dataset>",
    "python -m pardec.benchmarks.cover --mdm runs/mdm_b4/hf --out benchmarks/results/cover_new --threads 1",
    ".venv/bin/python -m pytest -q -m slurm",
    "PARDEC_NPROC_PER_NODE=2 sbatch scripts/slurm/validate.sbatch checkpoint=<dir> decoder=ar_greedy",
])
def test_a_sound_command_passes(line):
    assert [p for c in simple_commands(line) for p in command_problems(c)] == []


def _console_command(name: str) -> str:
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed next to {sys.executable} or on PATH: run bash scripts/setup.sh")
    return found


def test_commands_start():
    """``pardec-train --help`` and ``python -m pardec.cli.validate --help`` exit 0 and print Hydra's help
    (started side by side: each spends its time importing torch and transformers)."""
    argvs = [[_console_command("pardec-train"), "--help"], [sys.executable, "-m", "pardec.cli.validate", "--help"]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running = [subprocess.Popen(a, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for a in argvs]
    for argv, process in zip(argvs, running):
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"{argv}: exit {process.returncode}\n{output}"
        assert "Powered by Hydra" in output, f"{argv}: no Hydra help\n{output}"
