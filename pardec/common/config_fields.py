"""Typed config fields: choices and numeric ranges, each declared once where the field is declared and
checked in one pass over a whole config.

**Choices.** A field that takes one of a few words is typed with a :class:`Choice` subclass whose
members are named by their value (``cosine = "cosine"``). OmegaConf's enum nodes accept the plain word
from YAML or the command line and refuse any other, naming the key and the allowed words
(``trainer.schedule: Invalid value 'bogus', expected one of [cosine, linear, constant]``). A member is
a ``str``: it compares, hashes, formats and serialises (JSON, ``OmegaConf.to_yaml``) as its word, so
code written against the plain strings keeps working.

**Ranges.** A numeric field is declared with :func:`ranged` (``lr: float = ranged(3e-4, gt=0)``), which
stores a :class:`Range` in the dataclass field's metadata; for a list of numbers the range holds for
every element, for an ``Optional`` field it holds when the value is not null. Where 0 (or another
value) means "off", the range includes it and ``note`` says so; the error message repeats the note.

:func:`check_config` walks a config (a structured ``DictConfig`` or a dataclass instance; nested
configs included, whatever their declared type) and raises :class:`ConfigError` naming the key, the
value and the range (or the allowed words) of the first field outside it. Entry points run it at start:
``pardec.trainers.config.validate_train_config``, ``pardec.inference.config.validate_validate_config``,
``pardec.inference.decoders.registry.decoder_config`` and the ``Decoder`` and ``Method`` constructors.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from pardec.common.errors import ConfigError

RANGE = "range"  # the dataclass field metadata key ranged() sets


class Choice(str, enum.Enum):
    """Base of every config choice: members are ``word = "word"`` (checked when the class is made)."""

    def __init__(self, value: str):
        if self.name != value:
            raise TypeError(f"{type(self).__name__}.{self.name} = {value!r}: name a Choice member by its value")

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def _missing_(cls, value: object) -> None:
        raise ValueError(f"{value!r} is not a valid {cls.__name__}: expected one of {cls.words()}")

    @classmethod
    def words(cls) -> list[str]:
        return [m.value for m in cls]


@dataclasses.dataclass(frozen=True)
class Range:
    """Bounds of a numeric field: ``ge``/``gt`` below, ``le``/``lt`` above (None = unbounded)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    note: str = ""

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def __str__(self) -> str:
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        high = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if low and high:
            text = f"in {low}, {high}"
        elif low:
            text = (">= " if self.ge is not None else "> ") + low[1:]
        elif high:
            text = ("<= " if self.le is not None else "< ") + high[:-1]
        else:
            text = "any number"
        return f"{text} ({self.note})" if self.note else text


def ranged(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None, note: str = "",
           default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with a declared range, e.g. ``save_every: int = ranged(0, ge=0, note="0 = off")``."""
    if ge is not None and gt is not None or le is not None and lt is not None:
        raise TypeError("ranged(): give at most one lower bound (ge or gt) and one upper bound (le or lt)")
    meta = {RANGE: Range(ge=ge, gt=gt, le=le, lt=lt, note=note)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def choice_type(hint: Any) -> type[Choice] | None:
    """The :class:`Choice` class of a field annotation (``X`` or ``Optional[X]``), else None."""
    args = typing.get_args(hint) if typing.get_origin(hint) is typing.Union else (hint,)
    found = [a for a in args if isinstance(a, type) and issubclass(a, Choice)]
    return found[0] if found else None


def _schema(cfg: Any) -> type | None:
    cls = OmegaConf.get_type(cfg) if isinstance(cfg, DictConfig) else type(cfg)
    return cls if cls is not None and dataclasses.is_dataclass(cls) else None


def check_config(cfg: Any, prefix: str = "") -> None:
    """Check every declared range and every choice of ``cfg`` and the configs nested in it.

    ``prefix`` is the key of ``cfg`` in the whole config (``"decoder"``, ``"recipe"``; ``""`` for the
    root), so the error names the full key: ``config key 'trainer.lr' = -1.0; expected > 0``.
    """
    cls = _schema(cfg)
    if cls is None:
        return
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if isinstance(cfg, DictConfig):
            if OmegaConf.is_missing(cfg, f.name):
                continue
            value = cfg[f.name]
        else:
            value = getattr(cfg, f.name)
        if _schema(value) is not None:
            check_config(value, key)
            continue
        if value is None:
            continue
        choices = choice_type(hints.get(f.name))
        if choices is not None and not isinstance(value, choices) and value not in choices.words():
            raise ConfigError(f"config key '{key}' = {value!r}; expected one of [{', '.join(choices.words())}]")
        bounds = f.metadata.get(RANGE)
        if bounds is not None:
            _check_range(key, value, bounds)


def _check_range(key: str, value: Any, bounds: Range) -> None:
    is_list = isinstance(value, (ListConfig, list, tuple))
    for item in list(value) if is_list else [value]:
        if isinstance(item, bool) or not isinstance(item, (int, float)) or item not in bounds:
            shown = list(value) if is_list else value
            raise ConfigError(f"config key '{key}' = {shown!r}; expected {'every value ' if is_list else ''}{bounds}")
