"""Embedded default data: GSM8K-style word problems with a short chain of thought.

Each example is a plain-text prompt ``"Question: ...\\nAnswer:"`` and a response with one
chain-of-thought line per arithmetic step followed by ``"#### <answer>"``, e.g.::

    Question: Tom has 5 apples. He buys 3 more. He gives 2 to Mia. How many apples does Tom have now?
    Answer: Tom has 5 + 3 = 8 apples.
    Then Tom has 8 - 2 = 6 apples.
    #### 6

Three problem families (a counted collection, money, boxes of items) share one event vocabulary
(add, subtract, multiply by a small factor); every intermediate value is a non-negative integer
no larger than ``max_value``. Generation is deterministic from ``seed``: each split draws from its
own ``random.Random`` whose seed is a SHA-256 digest of ``(seed, split)``. The test prompts are
generated first and excluded from the train split, so the splits never share a prompt; the validation
split (``val``, for tuning decoders) excludes both the test and the train prompts.

**Fresh splits** ``fresh1``, ``fresh2``, ... (``num_fresh`` problems each) exclude the train, test and
val prompts (val at ``num_val``), each drawn from its own seed: problems nobody tuned on or reported on,
to check a table's numbers on new ones (``--split fresh1`` in the benchmarks, ``data.eval_split=fresh1``
in ``pardec-validate``). Adding them changed no other split.

:func:`vocabulary_texts` lists every template and word the generator can emit, so the embedded
tokenizer (``pardec.data_pipelines.synthetic_tokenizer``) covers the full output space, not a sample.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from omegaconf import OmegaConf

from pardec.common.config_fields import check_config, ranged

SPLIT_NAMES = ("train", "test", "val")
FRESH_SPLIT = re.compile(r"fresh[1-9][0-9]*")  # fresh1, fresh2, ...: the fresh splits (module doc)


@dataclass
class SyntheticGSMConfig:
    seed: int = ranged(1234, ge=0)
    num_train: int = ranged(20000, ge=0)
    num_test: int = ranged(200, ge=0)
    # Validation split for tuning decoders (thresholds, ...): disjoint from train and test, drawn
    # from its own seed after both, so adding it left train and test unchanged.
    num_val: int = ranged(200, ge=0)
    # Problems in each fresh split (fresh1, fresh2, ...): disjoint from train, test and val.
    num_fresh: int = ranged(200, ge=0)
    # Arithmetic steps (chain-of-thought lines) per problem.
    min_steps: int = ranged(2, ge=1)
    max_steps: int = ranged(3, ge=1)
    # Largest amount added or subtracted in one event (a purchase's total cost included) and
    # largest starting item count.
    max_operand: int = ranged(20, ge=2)
    # Multiplication factors are drawn from [2, max_multiplier].
    max_multiplier: int = ranged(4, ge=2)
    # No intermediate value or answer exceeds this.
    max_value: int = ranged(99, ge=2)
    # False: additions and subtractions only (no boxes family, no "each" purchases).
    allow_multiply: bool = True


# (name, subject pronoun, object pronoun)
PEOPLE = (
    ("Tom", "He", "him"),
    ("Ben", "He", "him"),
    ("Sam", "He", "him"),
    ("Jack", "He", "him"),
    ("Leo", "He", "him"),
    ("Mia", "She", "her"),
    ("Emma", "She", "her"),
    ("Lily", "She", "her"),
    ("Anna", "She", "her"),
    ("Zoe", "She", "her"),
)
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells", "stamps", "flowers")
CONTAINERS = ("boxes", "bags", "jars", "baskets")
PRICED_ITEMS = ("pens", "toys", "cakes", "hats", "balls", "games")
SINGLE_ITEMS = ("book", "kite", "lunch", "shirt", "puzzle", "ticket")

# Templates. Placeholders: {name} {pron} {obj} {friend} {k} {m} {items} {container} {thing}.
INVENTORY_START = "{name} has {k} {items}."
BOXES_START = "{name} has {m} {container} with {k} {items} in each."
MONEY_START = "{name} has {k} dollars."
ITEM_ADD = ("{pron} buys {k} more.", "{pron} finds {k} more.", "{friend} gives {obj} {k} more.")
ITEM_SUB = ("{pron} gives {k} to {friend}.", "{pron} sells {k} of them.", "{pron} loses {k} of them.")
ITEM_MUL = ("{pron} then buys enough to have {m} times as many.",)
MONEY_ADD = ("{pron} earns {k} dollars.", "{friend} gives {obj} {k} dollars.", "{pron} finds {k} dollars.")
MONEY_SUB = ("{pron} spends {k} dollars on a {thing}.", "{pron} pays {k} dollars for a {thing}.")
MONEY_BUY_EACH = ("{pron} buys {m} {items} that cost {k} dollars each.",)
ITEM_QUESTION = "How many {items} does {name} have now?"
MONEY_QUESTION = "How many dollars does {name} have now?"
PROMPT = "Question: {body}\nAnswer:"
LINE_FIRST = "{name} has {a} {op} {b} = {c} {unit}."
LINE_THEN = "Then {name} has {a} {op} {b} = {c} {unit}."
LINE_COST = "The {items} cost {a} * {b} = {c} dollars."
FINAL = "#### {c}"

_PLACEHOLDER = re.compile(r"\{[a-z]+\}")
_ANSWER = re.compile(r"####\s*(-?\d+)")
_NUMBER = re.compile(r"-?\d[\d,]*")


def vocabulary_texts() -> list[str]:
    """Every template (placeholders removed) and every word the generator can substitute."""
    templates = [
        INVENTORY_START, BOXES_START, MONEY_START, ITEM_QUESTION, MONEY_QUESTION, PROMPT,
        LINE_FIRST, LINE_THEN, LINE_COST, FINAL,
        *ITEM_ADD, *ITEM_SUB, *ITEM_MUL, *MONEY_ADD, *MONEY_SUB, *MONEY_BUY_EACH,
    ]
    words = [w for person in PEOPLE for w in person]
    words += [*ITEMS, *CONTAINERS, *PRICED_ITEMS, *SINGLE_ITEMS, "dollars", "+", "-", "*"]
    return [_PLACEHOLDER.sub(" ", t) for t in templates] + words


def extract_answer(text: str) -> str | None:
    """The integer after the last ``####`` in ``text`` (as a string), or None if there is none."""
    matches = _ANSWER.findall(text)
    return str(int(matches[-1])) if matches else None


def extract_last_number(text: str) -> str | None:
    """The last integer in ``text`` (commas allowed as thousands separators), or None: the lenient
    reading of an answer, for models not trained on the ``#### n`` format (an instruct model's
    zero-shot answer), as lm-eval's GSM8K "flexible-extract" does. :func:`extract_answer` is the
    strict one, the accuracy pardec reports."""
    matches = _NUMBER.findall(text)
    return str(int(matches[-1].replace(",", ""))) if matches else None


def split_seed(seed: int, split: str) -> int:
    """Stable per-split seed (SHA-256 of seed and split name; independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256(f"synthetic_gsm:{seed}:{split}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def is_split_name(split: str) -> bool:
    """Whether ``split`` names a split of the generator: train, test, val or a fresh one (fresh1, ...)."""
    return split in SPLIT_NAMES or bool(FRESH_SPLIT.fullmatch(split))


def generate_split(cfg: SyntheticGSMConfig, split: str) -> list[dict]:
    """``cfg.num_train``, ``cfg.num_test``, ``cfg.num_val`` or ``cfg.num_fresh`` unique examples with keys
    prompt, response, answer. Test is drawn first, train excludes its prompts, val excludes both, and a
    fresh split (``fresh<k>``, k >= 1) excludes all three."""
    if not is_split_name(split):
        raise ValueError(f"split must be one of {SPLIT_NAMES} or fresh<k> (k >= 1, e.g. fresh1), got {split!r}")
    if not isinstance(cfg, SyntheticGSMConfig):  # an OmegaConf node: read once, not per attribute access
        cfg = SyntheticGSMConfig(**OmegaConf.to_container(cfg))
    _check_config(cfg)
    test = _generate(cfg, cfg.num_test, random.Random(split_seed(cfg.seed, "test")), exclude=set())
    if split == "test":
        return test
    exclude = {row["prompt"] for row in test}
    train = _generate(cfg, cfg.num_train, random.Random(split_seed(cfg.seed, "train")), exclude)
    if split == "train":
        return train
    exclude |= {row["prompt"] for row in train}
    val = _generate(cfg, cfg.num_val, random.Random(split_seed(cfg.seed, "val")), exclude)
    if split == "val":
        return val
    exclude |= {row["prompt"] for row in val}
    return _generate(cfg, cfg.num_fresh, random.Random(split_seed(cfg.seed, split)), exclude)


def _check_config(cfg: SyntheticGSMConfig) -> None:
    check_config(cfg, "data.synthetic")  # the declared ranges; below, what relates two fields
    if cfg.min_steps > cfg.max_steps:
        raise ValueError(f"synthetic: need min_steps <= max_steps, got {cfg.min_steps}, {cfg.max_steps}")
    if cfg.max_value < cfg.max_operand:
        raise ValueError(f"synthetic: need max_operand <= max_value, got {cfg.max_operand}, {cfg.max_value}")
    if cfg.allow_multiply and cfg.max_value < 4:
        raise ValueError(f"synthetic: allow_multiply needs max_value >= 4, got {cfg.max_value}")


def _generate(cfg: SyntheticGSMConfig, count: int, rng: random.Random, exclude: set[str]) -> list[dict]:
    rows: list[dict] = []
    seen = set(exclude)
    attempts = 0
    while len(rows) < count:
        attempts += 1
        if attempts > 100 * count + 1000:
            raise ValueError(f"synthetic: could not draw {count} distinct problems; make the problems harder")
        row = _problem(cfg, rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return rows


class _Builder:
    """Accumulates prompt sentences and chain-of-thought lines while tracking the running value."""

    def __init__(self, name: str, value: int, unit: str) -> None:
        self.name, self.value, self.unit = name, value, unit
        self.sentences: list[str] = []
        self.lines: list[str] = []
        self.has_line = False

    def apply(self, op: str, b: int) -> None:
        a = self.value
        self.value = {"+": a + b, "-": a - b, "*": a * b}[op]
        template = LINE_THEN if self.has_line else LINE_FIRST
        self.lines.append(template.format(name=self.name, a=a, op=op, b=b, c=self.value, unit=self.unit))
        self.has_line = True


def _problem(cfg: SyntheticGSMConfig, rng: random.Random) -> dict:
    name, pron, obj = rng.choice(PEOPLE)
    friend = rng.choice([p[0] for p in PEOPLE if p[0] != name])
    steps = rng.randint(cfg.min_steps, cfg.max_steps)
    families = ["inventory", "money"] + (["boxes"] if cfg.allow_multiply else [])
    family = rng.choice(families)
    fill = {"name": name, "pron": pron, "obj": obj, "friend": friend}

    if family == "money":
        b = _Builder(name, rng.randint(2, cfg.max_value), "dollars")
        b.sentences.append(MONEY_START.format(name=name, k=b.value))
        while len(b.lines) < steps:
            _money_event(cfg, rng, b, fill, steps - len(b.lines))
        question = MONEY_QUESTION.format(name=name)
    else:
        items = rng.choice(ITEMS)
        fill["items"] = items
        if family == "boxes":
            m = rng.randint(2, min(cfg.max_multiplier, cfg.max_value // 2))
            k = rng.randint(2, min(cfg.max_operand, cfg.max_value // m))
            b = _Builder(name, m, items)
            b.sentences.append(BOXES_START.format(name=name, m=m, container=rng.choice(CONTAINERS), k=k, items=items))
            b.apply("*", k)
        else:
            b = _Builder(name, rng.randint(2, cfg.max_operand), items)
            b.sentences.append(INVENTORY_START.format(name=name, k=b.value, items=items))
        while len(b.lines) < steps:
            _item_event(cfg, rng, b, fill)
        question = ITEM_QUESTION.format(items=items, name=name)

    body = " ".join([*b.sentences, question])
    response = " " + "\n".join([*b.lines, FINAL.format(c=b.value)])
    return {"prompt": PROMPT.format(body=body), "response": response, "answer": str(b.value)}


def _item_event(cfg: SyntheticGSMConfig, rng: random.Random, b: _Builder, fill: dict) -> None:
    options = []
    if b.value + 1 <= cfg.max_value:
        options.append("+")
    if b.value >= 1:
        options.append("-")
    if cfg.allow_multiply and 2 <= b.value * 2 <= cfg.max_value:
        options.append("*")
    op = rng.choice(options)
    if op == "*":
        m = rng.randint(2, min(cfg.max_multiplier, cfg.max_value // b.value))
        b.sentences.append(rng.choice(ITEM_MUL).format(m=m, **fill))
        b.apply("*", m)
        return
    k = _amount(cfg, rng, b.value, op)
    b.sentences.append(rng.choice(ITEM_ADD if op == "+" else ITEM_SUB).format(k=k, **fill))
    b.apply(op, k)


def _money_event(cfg: SyntheticGSMConfig, rng: random.Random, b: _Builder, fill: dict, steps_left: int) -> None:
    options = []
    if b.value + 1 <= cfg.max_value:
        options.append("+")
    if b.value >= 1:
        options.append("-")
    if cfg.allow_multiply and steps_left >= 2 and b.value >= 2:
        options.append("each")
    op = rng.choice(options)
    if op == "each":
        m = rng.randint(2, min(cfg.max_multiplier, b.value, cfg.max_operand))
        price = rng.randint(1, min(cfg.max_operand, b.value) // m)
        items = rng.choice(PRICED_ITEMS)
        b.sentences.append(rng.choice(MONEY_BUY_EACH).format(m=m, items=items, k=price, **fill))
        b.lines.append(LINE_COST.format(items=items, a=m, b=price, c=m * price))
        b.apply("-", m * price)
        return
    k = _amount(cfg, rng, b.value, op)
    thing = rng.choice(SINGLE_ITEMS)
    b.sentences.append(rng.choice(MONEY_ADD if op == "+" else MONEY_SUB).format(k=k, thing=thing, **fill))
    b.apply(op, k)


def _amount(cfg: SyntheticGSMConfig, rng: random.Random, value: int, op: str) -> int:
    """An amount to add (keeping the value <= max_value) or subtract (keeping it >= 0)."""
    high = min(cfg.max_operand, cfg.max_value - value if op == "+" else value)
    return rng.randint(1, high)
