"""Full cache: the uncompressed baseline."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .base import Policy


@dataclasses.dataclass
class Full(Policy):
    """Keep every token. Generation with it matches ``model.generate`` token for token."""

    name: ClassVar[str] = "full"
    supports_latent: ClassVar[bool] = True
    takes_budget: ClassVar[bool] = False
    budget_fields: ClassVar[tuple[str, ...]] = ()
