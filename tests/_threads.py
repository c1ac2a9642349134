"""Racing calls for the concurrency tests: one function called from N threads released together."""
from __future__ import annotations

import threading
from typing import Any, Callable


def race(fn: Callable[[], Any], n: int) -> tuple[list[Any], list[BaseException]]:
    """(results, errors) of `n` concurrent calls of `fn`, in completion order."""
    barrier = threading.Barrier(n)
    results: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        barrier.wait()
        try:
            results.append(fn())
        except Exception as exc:  # noqa: BLE001 - returned to the test, which asserts on it
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors
