"""Time limits in the tests catch hangs only: a deadlock, a peer that never comes, a wait on
a hook that never returns. They never judge speed. Each is many times what the step takes
on a loaded 2-core machine (the slowest step bounded here, a pytest subprocess running a
contract suite, took 44 s with other work on the machine), so reaching one means that
something waits for ever, not that the machine is slow. Decisions made from a measurement
are tested with an injected timer or clock instead (see tests/test_keep_fastest.py)."""

from __future__ import annotations

# Seconds for any bounded step: a child process (doctor, a pytest run, torchrun with its
# ranks, one distributed rank) to finish, a wait on another process or thread to end.
HANG_S = 600.0
