"""Names in messages: did-you-mean suggestions for names a user types (commands, backends,
levels, config keys), and long lists of names cut short.

Plain Python (difflib), no torch: the command line uses it before anything heavy loads.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Sequence

# difflib's similarity (2 x matching characters / both lengths) a suggestion needs. Its
# default, 0.6, offers 'float8' for 'lots'; 0.65 still finds 'mlp' for 'mpl' (0.67).
CUTOFF = 0.65


def close_matches(word: str, choices: Iterable[str], *, limit: int = 3) -> list[str]:
    """The choices closest to `word`, best first, compared without regard to case; empty
    when none is close (see CUTOFF)."""
    by_lower: dict[str, str] = {}
    for choice in choices:
        by_lower.setdefault(choice.lower(), choice)
    found = difflib.get_close_matches(word.lower(), list(by_lower), n=limit, cutoff=CUTOFF)
    return [by_lower[match] for match in found]


def did_you_mean(word: str, choices: Iterable[str], *,
                 show: Callable[[str], str] = repr) -> str:
    """"; did you mean 'x'?" for the choice closest to `word`, else "". `show` renders the
    choice (repr by default: quoted)."""
    matches = [m for m in close_matches(word, choices) if m != word]
    return f"; did you mean {show(matches[0])}?" if matches else ""


def shortened(names: Sequence[str], limit: int, sep: str = ", ") -> str:
    """The first `limit` names joined by `sep`, then " and N more" for the rest."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return sep.join(names[:limit]) + more
