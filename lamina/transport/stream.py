"""Incremental decoding of the wire protocol from a byte stream (shm rings, tcp sockets): the
same checks as :func:`lamina.transport.wire.decode`, made as soon as each part has arrived."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lamina.transport.wire import (DEFAULT_LIMITS, HEADER_SIZE, Header, Message, TensorDesc,
                                   WireError, WireLimits, assemble, unpack_header,
                                   unpack_preamble)

__all__ = ["StreamDecoder"]


class StreamDecoder:
    """Incremental decoder for a byte stream carrying messages back to back.

    Usage (any transport)::

        view = dec.buffer()      # writable memoryview, never empty: the bytes wanted next
        n = fill(view)           # put up to len(view) stream bytes at its start
        msg = dec.advance(n)     # a Message when one completed, else None

    The header is validated as soon as its 48 bytes are in, and the descriptors and meta as soon
    as they are in, *before* the body is allocated; a violation raises :class:`WireError` and
    poisons the decoder (the stream cannot be resynchronised), so every later call raises too.
    Completed messages own their (freshly allocated) body buffer.
    """

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._error: WireError | None = None
        self._reset()

    def _reset(self) -> None:
        self.in_progress = False  # True once part of a message has been received
        self._stage = 0  # 0 header, 1 preamble, 2 body
        self._buf: Any = bytearray(HEADER_SIZE)
        self._got = 0
        self._header: Header | None = None
        self._descs: list[TensorDesc] = []
        self._meta: dict[str, Any] = {}
        self._body: torch.Tensor | None = None

    def poison(self, exc: WireError) -> None:
        """Mark the stream corrupt (a message taken from it another way was malformed): every
        later call raises."""
        self._error = exc

    def buffer(self) -> memoryview:
        if self._error is not None:
            raise WireError(f"stream is corrupt after an earlier error: {self._error}")
        return memoryview(self._buf)[self._got:]

    def advance(self, n: int) -> Message | None:
        if self._error is not None:
            raise WireError(f"stream is corrupt after an earlier error: {self._error}")
        self._got += n
        self.in_progress = self._got > 0 or self._stage > 0
        try:
            while self._got == len(self._buf):
                msg = self._step()
                if msg is not None:
                    return msg
        except WireError as exc:
            self._error = exc
            raise
        return None

    def _step(self) -> Message | None:
        if self._stage == 0:
            self._header = unpack_header(self._buf, self.limits)
            self._head_bytes = bytes(self._buf)
            self._stage, self._buf, self._got = 1, bytearray(self._header.preamble_len), 0
            return None
        assert self._header is not None
        if self._stage == 1:
            self._descs, self._meta = unpack_preamble(self._header, self._buf, self.limits)
            self._body = torch.empty(self._header.total_len, dtype=torch.uint8)
            arr = self._body.numpy()
            k = HEADER_SIZE + self._header.preamble_len
            arr[:HEADER_SIZE] = np.frombuffer(self._head_bytes, dtype=np.uint8)
            arr[HEADER_SIZE:k] = np.frombuffer(bytes(self._buf), dtype=np.uint8)
            self._stage, self._buf, self._got = 2, arr, k
            return None
        assert self._body is not None
        msg = assemble(self._header, self._descs, self._meta, self._body)
        self._reset()
        return msg
