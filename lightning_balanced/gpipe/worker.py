"""One worker thread per partition: the tasks of a clock cycle run on their partitions' threads at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["PartitionWorkers"]


class PartitionWorkers:
    """A dedicated thread for each partition (each of its tasks runs on it, in submission order).

    On CUDA the thread makes its partition's device current and computes on the partition's own stream
    (:attr:`streams`), so partitions that share a GPU still overlap. Threads are kept between steps until
    :meth:`close`.
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self._executors = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"gpipe-partition-{j}") for j in range(len(devices))
        ]
        # One compute stream per partition (not per device); None off CUDA.
        self.streams: list[torch.cuda.Stream | None] = [
            torch.cuda.Stream(device) if device.type == "cuda" else None for device in self.devices
        ]

    def _run(self, partition: int, task: Callable[[], Any]) -> Any:
        device, stream = self.devices[partition], self.streams[partition]
        if stream is not None:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                return task()
        return task()

    def run_cycle(self, tasks: Sequence[tuple[int, int, Callable[[], Any]]]) -> list[Any]:
        """Run ``(micro_batch, partition, task)`` triples, each on its partition's thread, and wait for all.

        Returns:
            list: the tasks' results, in order.

        Raises:
            Exception: the first failing task's own exception (after all tasks of the cycle finished), with a note
                naming the micro-batch, partition and device.
        """
        futures: list[Future[Any]] = [self._executors[j].submit(self._run, j, task) for _, j, task in tasks]
        results: list[Any] = []
        error: BaseException | None = None
        for (i, j, _), future in zip(tasks, futures, strict=True):
            try:
                results.append(future.result())
            except Exception as err:
                if error is None:
                    if hasattr(err, "add_note"):  # Python >= 3.11
                        err.add_note(f"(raised in gpipe partition {j} on {self.devices[j]}, micro-batch {i})")
                    error = err
        if error is not None:
            raise error
        return results

    def close(self) -> None:
        """Stop the threads (after their current task)."""
        for executor in self._executors:
            executor.shutdown(wait=True)
        self._executors = []
