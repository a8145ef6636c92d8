"""The one optimization-levels enum (O0-O3) and its seed aliases."""

from __future__ import annotations

import enum
import re

from torchbridge.errors import ConfigurationError
from torchbridge.suggestions import did_you_mean

_ALIASES = {"none": "O0", "conservative": "O1", "balanced": "O2", "aggressive": "O3"}


class OptimizationLevel(str, enum.Enum):
    """O0 placement only; O1 exact rewrites; O2 mixed precision + compile; O3 maximum."""

    O0 = "O0"
    O1 = "O1"
    O2 = "O2"
    O3 = "O3"

    @classmethod
    def parse(cls, value: object) -> OptimizationLevel:
        """Accept an enum member, "O2", "o2", 2, or an alias such as "balanced"."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
            return cls(f"O{value}")
        if isinstance(value, str):
            text = value.strip()
            text = _ALIASES.get(text.lower(), text.upper())
            if text in cls.__members__:
                return cls(text)
        raise ConfigurationError(unknown_level_message(value), field="optimization_level",
                                 value=value)

    @property
    def rank(self) -> int:
        return int(self.value[1])

    def __ge__(self, other: object) -> bool:  # type: ignore[override]
        return self.rank >= OptimizationLevel.parse(other).rank

    def __gt__(self, other: object) -> bool:  # type: ignore[override]
        return self.rank > OptimizationLevel.parse(other).rank

    def __le__(self, other: object) -> bool:  # type: ignore[override]
        return self.rank <= OptimizationLevel.parse(other).rank

    def __lt__(self, other: object) -> bool:  # type: ignore[override]
        return self.rank < OptimizationLevel.parse(other).rank


def unknown_level_message(value: object) -> str:
    """Why `value` is not a level, with the choices and the nearest one."""
    choices = ", ".join([*OptimizationLevel.__members__, *_ALIASES])
    message = f"unknown optimization level {value!r}; choose one of {choices}"
    text = str(value).strip()
    number = re.fullmatch(r"[oO]?(\d+)", text)
    if number is not None and int(number.group(1)) > 3:
        return f"{message} (O3 is the highest)"
    return message + did_you_mean(text, [*OptimizationLevel.__members__, *_ALIASES])


# Max relative output drift against O0 per level: O0/O1 exact up to float32 rounding; O2/O3
# may compute in a 16-bit dtype (bf16 has 8 bits of mantissa: ~4e-3 per rounding).
LEVEL_TOLERANCE = {"O0": 1e-6, "O1": 1e-4, "O2": 3e-2, "O3": 3e-2}
