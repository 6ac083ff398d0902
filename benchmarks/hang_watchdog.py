"""What the hang watchdog costs per step: ``ProgressWatchdog.beat`` (called 3 times per training batch by
``HangWatchdog``) against a loop doing nothing, armed, in one process. Prints ns per beat; no assertion.

    python benchmarks/hang_watchdog.py
"""

from __future__ import annotations

import tempfile
import time

from trainforge.strategies.watchdog import ProgressWatchdog

N = 1_000_000


def main() -> None:
    dog = ProgressWatchdog(600, tempfile.mkdtemp())
    dog.start()
    t0 = time.perf_counter()
    for _ in range(N):
        pass
    empty = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(N):
        dog.beat("training batch ended")
    beats = time.perf_counter() - t0
    dog.stop()
    print(f"beat: {(beats - empty) / N * 1e9:.0f} ns (3 per training batch; a step takes milliseconds)")


if __name__ == "__main__":
    main()
