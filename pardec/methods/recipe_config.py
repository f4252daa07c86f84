"""Fields every recipe config shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List


@dataclass
class RecipeConfig:
    name: str = "???"
    # Multi-stage recipes: each stage is {name: str, max_steps: int, overrides: {recipe key: value}}.
    # Empty = one stage with the recipe as configured and trainer.max_steps.
    stages: List[Dict[str, Any]] = field(default_factory=list)
