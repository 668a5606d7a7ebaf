"""The data sets the trainer reads, built from the `data` config group, and a background prefetcher."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Protocol

from runtime.models import FeatureSpec, PCVRBatch

from .config import PARQUET_JAGGED, DataSource


class PCVRData(Protocol):
    spec: FeatureSpec

    def train_batch(self, index: int, batch_size: int) -> PCVRBatch: ...

    def val_set(self) -> PCVRBatch: ...


def build_data(cfg, seed: int, jagged: bool = False) -> PCVRData:
    """The data set of the `data` group; jagged: packed histories (the resolved data.jagged, see config.data_jagged)."""
    source = DataSource(cfg.source.value if isinstance(cfg.source, DataSource) else cfg.source)
    if source is DataSource.parquet:
        if jagged:
            raise ValueError(PARQUET_JAGGED)
        from .parquet import ParquetPCVR

        if not cfg.path:
            raise ValueError("data.path: expected the directory of train.parquet and val.parquet for data=parquet")
        return ParquetPCVR(cfg.path, seed=seed)
    from .synthetic import SyntheticPCVR

    return SyntheticPCVR(
        seed=seed,
        seq_len=cfg.seq_len,
        n_items=cfg.n_items,
        n_categories=cfg.n_categories,
        n_dense=cfg.n_dense,
        val_size=cfg.val_size,
        sparse_tables=cfg.sparse_tables,
        sparse_vocab=cfg.sparse_vocab,
        sparse_hotness=cfg.sparse_hotness,
        n_users=cfg.n_users,
        jagged=jagged,
    )


def batches(
    data: PCVRData, indices: Iterator[int], batch_size: int, prefetch: int = 0, pin_memory: bool = False
) -> Iterator[PCVRBatch]:
    """data.train_batch(i) for each index, made up to `prefetch` batches ahead in a daemon thread
    (making a batch is mostly torch ops, which release the GIL). Batches depend only on their index,
    so prefetching changes nothing in what is trained on."""

    def make(index: int) -> PCVRBatch:
        batch = data.train_batch(index, batch_size)
        return batch.pin_memory() if pin_memory else batch

    if prefetch <= 0:
        for index in indices:
            yield make(index)
        return
    ready: queue.Queue = queue.Queue(maxsize=prefetch)
    stop = threading.Event()

    def work() -> None:
        try:
            for index in indices:
                if stop.is_set():
                    return
                ready.put(make(index))
        except BaseException as error:  # handed to the consumer, raised there
            ready.put(error)
            return
        ready.put(None)

    thread = threading.Thread(target=work, name="pcvr-prefetch", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                ready.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.05)
