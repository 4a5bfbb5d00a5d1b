"""RunClock: wall time less the time this process was stopped.

On the shared benchmark machine, processes at low priority are paused (SIGSTOP) while someone else measures; a
benchmark that reads plain wall time then counts the pause against whichever run it fell in. A thread ticks every
20 ms; a gap longer than 0.5 s between two ticks is counted as paused and left out of every interval.
"""

from __future__ import annotations

import threading
import time


class RunClock:
    def __init__(self) -> None:
        self.paused = 0.0
        self._stop = threading.Event()
        threading.Thread(target=self._tick, daemon=True, name="run-clock").start()

    def _tick(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.02):
            now = time.monotonic()
            if now - last > 0.5:
                self.paused += now - last - 0.02
            last = now

    def now(self) -> float:
        return time.monotonic() - self.paused

    def close(self) -> None:
        self._stop.set()
