"""Full cache: the uncompressed baseline."""

from __future__ import annotations

import dataclasses

from .base import Policy


@dataclasses.dataclass
class Full(Policy):
    """Keep every token. Generation with it matches ``model.generate`` token for token."""
