"""The feeder's socket to its data-parallel workers: the wire format, the feeder's server, a worker's client.

The process RunFab started keeps stdin and the feeder (feeder.py); each worker that
runtime/launcher.py starts connects back over a local socket (``new_listener``, authenticated by a
key the worker's spec carries) and receives its rank's share of every update. ``serve_feeder``
sends each rank its items in the background; ``FeederConnection`` is a worker's end, which hands
Lightning its microbatches and puts held-out documents into the worker's own pool.

The wire carries raw tensor bytes behind a JSON header (no pickle): see ``send_item``. A worker
acknowledges every microbatch it takes, and the feeder keeps at most ``data.prefetch_updates``
updates in flight per rank, so a stop never has megabytes of updates in a socket to recall.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from multiprocessing.connection import Client, Connection, Listener
from typing import NamedTuple

import numpy as np
import torch

from pipeline.feeder import INPUT_PENDING, ValidationClosed, ValidationDocument
from pipeline.report_marks import ReportMarks


# ----------------------------------------------------------------------------- wire format


def send_item(conn: Connection, item: object) -> None:
    """A microbatch (dict of tensors and ints), a held-out document, the held-out set's closing, the end,
    or an error."""
    if isinstance(item, dict):
        tensors = {k: v for k, v in item.items() if torch.is_tensor(v)}
        header = {
            "kind": "batch",
            "tensors": [[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in tensors.items()],
            "ints": {k: int(v) for k, v in item.items() if not torch.is_tensor(v)},
        }
        conn.send_bytes(json.dumps(header).encode())
        conn.send_bytes(b"".join(v.contiguous().numpy().tobytes() for v in tensors.values()))
    elif isinstance(item, ValidationDocument):
        conn.send_bytes(json.dumps({"kind": "validation", "length": len(item.tokens)}).encode())
        conn.send_bytes(item.tokens.astype(np.int32).tobytes())
    elif isinstance(item, ValidationClosed):
        conn.send_bytes(json.dumps({"kind": "validation_closed", **vars(item)}).encode())
    elif isinstance(item, BaseException):
        conn.send_bytes(json.dumps({"kind": "error", "message": f"{type(item).__name__}: {item}"}).encode())
    else:  # the end: an End, or None
        end = item or End()
        conn.send_bytes(json.dumps({"kind": "end", "early": end.early, "input": end.input_summary}).encode())


class End(NamedTuple):
    """The end of a rank's stream: why it came early (a signal, an input error) or None at the end of
    input or a step limit, and the feeder's input summary, which rank 0 writes into the run record."""

    early: str | None = None
    input_summary: dict | None = None


def receive_items(conn: Connection, on_end=lambda end: None) -> Iterator[dict | np.ndarray | ValidationClosed]:
    """Microbatches (dicts), held-out documents (int32 arrays) and the held-out set's closing until the
    feeder says it ended; ``on_end`` receives the End."""
    while True:
        header = json.loads(conn.recv_bytes())
        if header["kind"] == "end":
            on_end(End(header.get("early"), header.get("input")))
            return
        if header["kind"] == "error":
            raise RuntimeError(f"the feeder stopped: {header['message']}")
        if header["kind"] == "validation_closed":
            yield ValidationClosed(header["closed_by"], header["after_updates"], header["documents_read"])
            continue
        payload = conn.recv_bytes()
        if header["kind"] == "validation":
            yield np.frombuffer(payload, dtype=np.int32).copy()
            continue
        batch: dict = dict(header["ints"])
        offset = 0
        for name, dtype, shape in header["tensors"]:
            tensor_dtype = getattr(torch, dtype)
            count = int(np.prod(shape))
            size = count * tensor_dtype.itemsize
            batch[name] = torch.frombuffer(bytearray(payload[offset : offset + size]), dtype=tensor_dtype).view(shape)
            offset += size
        yield batch


# ----------------------------------------------------------------------------- the feeder's side


def serve_feeder(feeder, listener: Listener, world_size: int) -> threading.Thread:
    """In the background: accept each rank's connection, then stream it that rank's items.

    Accepting happens off the main thread, so a worker that dies before it connects is seen
    by the launcher (runtime/launcher.py WorkerGroup.wait) instead of hanging the feeder.
    """
    thread = threading.Thread(target=_serve, args=(feeder, listener, world_size), name="feeder-server", daemon=True)
    thread.start()
    return thread


def _serve(feeder, listener: Listener, world_size: int) -> None:
    connections: dict[int, Connection] = {}
    try:
        for _ in range(world_size):
            conn = listener.accept()
            connections[int(conn.recv_bytes())] = conn
    except OSError:
        return  # the listener was closed: the run is being torn down

    # Microbatches a rank may have in flight (sent, not yet taken by its training loop): the
    # socket's own buffers would otherwise hold megabytes of updates that a stop cannot recall.
    window = feeder.settings.data.prefetch_updates * feeder.settings.accumulation

    def send(rank: int) -> None:
        conn = connections[rank]
        in_flight = 0
        try:
            for item in feeder.iterate(rank):
                if isinstance(item, dict):
                    while in_flight >= window:
                        conn.recv_bytes()  # the worker took one
                        in_flight -= 1
                    in_flight += 1
                send_item(conn, item)
            send_item(conn, End(feeder.early_end, feeder.stats.as_dict()))
            _drain(conn)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            feeder.stop()  # the worker is gone; the launcher's wait reports why
        except BaseException as error:
            feeder.error = error
            try:
                send_item(conn, error)
            except OSError:
                pass

    threads = [threading.Thread(target=send, args=(rank,), daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _drain(conn: Connection) -> None:
    """Read the worker's last acknowledgements until it closes its end. A socket closed with unread
    bytes resets the connection, and the worker could lose the end of the stream still in flight."""
    try:
        while True:
            conn.recv_bytes()
    except (EOFError, OSError):
        pass


def new_listener() -> tuple[Listener, bytes]:
    """The feeder's socket on this host, and the key a worker must present to connect."""
    authkey = secrets.token_bytes(16)
    return Listener(("127.0.0.1", 0), authkey=authkey), authkey


# ----------------------------------------------------------------------------- a worker's side


class FeederConnection:
    """A worker's end of the socket: training microbatches for Lightning, held-out documents into the pool."""

    def __init__(self, address: tuple[str, int], authkey: bytes, rank: int, pool, microbatches_per_update: int) -> None:
        self.conn = Client(address, authkey=authkey)
        self.conn.send_bytes(str(rank).encode())
        self.pool = pool
        self.early_end: str | None = None  # the feeder's reason for ending before the input did
        self.input_summary: dict | None = None  # what the feeder read, sent with the end
        self._done = False
        self._acknowledging = True
        self._per_update = microbatches_per_update
        self._taken = 0
        self.report_marks = ReportMarks()  # the updates the feeder marked for a metric line

    def batches(self) -> Iterator[dict]:
        """Lightning's microbatches, with INPUT_PENDING first whenever an update after the first has
        not arrived when asked for (as the feeder's ``iterate(mark_waits=True)``).

        The stream always ends after one: a stand-in costs Lightning one more step of its loop, and
        each step starts with a collective (its SIGTERM broadcast), so every rank must take the
        same number, whether or not its end had already arrived.
        """
        if self._done:
            return
        items = receive_items(self.conn, on_end=self._ended)
        while True:
            boundary = self._taken and self._taken % self._per_update == 0
            marked = boundary and not self.conn.poll()
            if marked:
                yield INPUT_PENDING
            item = next(items, None)
            if item is None:
                if boundary and not marked:
                    yield INPUT_PENDING
                break
            if isinstance(item, np.ndarray):
                self.pool.offer(item)
                continue
            if isinstance(item, ValidationClosed):
                self.pool.close(item.closed_by, item.after_updates, item.documents_read)
                continue
            if item.pop("report", 0):  # the feeder's mark travels on the wire, not into training_step
                self.report_marks.mark(self._taken // self._per_update + 1)
            self._taken += 1
            self._acknowledge()
            yield item
        self._done = True

    def _ended(self, end: End) -> None:
        self.early_end, self.input_summary = end.early, end.input_summary

    def _acknowledge(self) -> None:
        """Taken: the feeder may send one more (see _serve). Once it has sent its last item it closes
        its end, and the items still in the socket need no acknowledgement."""
        if self._acknowledging:
            try:
                self.conn.send_bytes(b"")
            except (BrokenPipeError, ConnectionResetError):
                self._acknowledging = False

    def close(self) -> None:
        self.conn.close()
