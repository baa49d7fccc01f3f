"""The C++ surfaces of one end of a ring link (:class:`~lamina.transport.ring.RingChannel`),
for native code that sends or receives on it without Python per message: a whole-step program's
exchange, a memory node's writer and its serving loop, a wait over several rings. Each hands
over addresses inside the end's fast-path state and says which of the end's locks its user
holds; where the fast path cannot take the ring (no C++ module, a mirrored ring that must be
published, a message half decoded) each answers None and the caller takes the Python path.
"""
from __future__ import annotations

from typing import Callable

from lamina.transport.base import ChannelClosed
from lamina.transport.wire import MsgKind
from lamina.types import NativeExchange


class NativeEnd:
    """The native-consumer half of :class:`~lamina.transport.ring.RingChannel` (it sets the
    state read here: ``_tx``/``_rx`` memories, ``_writer``/``_reader`` fast ends,
    ``_exchange``, ``_fast``, the locks, the decoder)."""

    def native_exchange(self, kind: MsgKind, reply_to: int, reply: MsgKind, spin_ns: int,
                        yield_every: int, skip: MsgKind | None = None) -> NativeExchange | None:
        """``RingChannel.exchange`` as a C++ function (``lamina/csrc/exchange.h``) for a
        whole-step program: each call sends a ``kind`` message of q/k/v with ``reply_to`` and
        takes its ``reply`` as ``RingChannel.exchange`` does (a reply not taken is then
        ``recv``'s), first dropping any ``skip`` messages without tensors or meta that come
        before it. This
        end's send and receive locks are held from here until the result's ``done()`` (its
        caller is this end's only receiver); None, holding nothing, where there is no native
        exchange or a message is half decoded."""
        if self._exchange is None:
            return None
        self._tx_lock.acquire()
        self._rx_lock.acquire()
        try:
            if self._closed or self._dec.in_progress:
                self._release_exchange()
                return None
            end = self._fast.RingExchange(*self._exchange.args, reply_to, int(kind), int(reply),
                                          spin_ns, yield_every, -1 if skip is None else int(skip))
        except BaseException:
            self._release_exchange()
            raise
        return NativeExchange(self._fast.exchange_fn, end.handle(), self._release_exchange,
                              owner=end)

    def _release_exchange(self) -> None:
        self._rx_lock.release()
        self._tx_lock.release()


    def native_tx(self) -> tuple[int, int, int, int, int] | None:
        """``(ctl, data, capacity, head address, data doorbell fd or -1)`` of the send ring, for
        a native writer that its owner serialises with this end's other sends; None where a
        write must be published (a mirrored ring) or there is no fast path."""
        if self._writer is None or self._tx.mirrored:
            return None
        return (self._tx.ctl_addr, self._tx.data_addr, self._tx.capacity, self._writer.head_addr,
                getattr(self._tx.data_bell, "fd", -1))

    def serve_native(self, serve: Callable[..., int]) -> int | None:
        """Let a native consumer read the receive ring, holding the receive lock: ``serve(ctl,
        data, capacity, tail address, data doorbell fd, space doorbell fd (-1: none), spin_ns,
        yield_every, budget_ns)`` takes whole messages off it (waiting as this end's receivers
        do, for at most one liveness-check interval) and returns its status. None (``serve``
        not called) where a message is half decoded, a read must be published (mirrored) or
        there is no fast path: then :meth:`recv`."""
        with self._rx_lock:
            if self._closed:
                raise ChannelClosed("channel is closed")
            self._on_check()  # the tidying a Python receive does (a creator's names, once attached)
            if self._reader is None or self._rx.mirrored or self._dec.in_progress:
                return None
            rx = self._rx
            return serve(rx.ctl_addr, rx.data_addr, rx.capacity, self._reader.tail_addr,
                         getattr(rx.data_bell, "fd", -1), getattr(rx.space_bell, "fd", -1),
                         self._spin_ns, self._yield_every, int(self._wake * 1e9))

    def wait_handle(self) -> tuple[int, int, int] | None:
        """``(ctl, tail address, data doorbell fd or -1)`` of the receive ring, for a wait over
        several rings (:class:`~lamina.transport.waitset.WaitSet`) by the one thread that
        receives on this end; None where a read must be published (mirrored) or there is no
        fast path."""
        if self._reader is None or self._rx.mirrored:
            return None
        return (self._rx.ctl_addr, self._reader.tail_addr, getattr(self._rx.data_bell, "fd", -1))
