"""``fdatasync`` without a thread of ours: Linux native AIO (``IOCB_CMD_FDSYNC``) — a
prototype for ``bench.journal`` (issue #23 item 2; performance.md "One lane at the disk's
speed"), not runtime code.

The kernel runs an AIO ``fdatasync`` on a worker of its own (since Linux 4.18) and, with
``IOCB_FLAG_RESFD``, signals an ``eventfd`` once it is done; the Trio task that submitted it
waits on that ``eventfd`` with :func:`trio.lowlevel.wait_readable`. So a durable append costs
one ``io_submit`` and one wake-up of the Trio loop — no hand-off to a thread of ours, no GIL
passed back and forth — and the loop itself never waits for the device.

One context (``io_setup``) per store, shared by every call; an ``eventfd`` per call in flight,
taken from a free list (so the descriptors follow what is in flight, not the number of logs).
A completion is reaped by whichever waiter reads the ring first (``io_getevents`` with no
wait) and handed to its owner by the call's token; a waiter's own ``eventfd`` is signalled
only after its event is in the ring, so once it fired the result is there or was reaped.

:func:`open_aio` answers ``None`` where the kernel refuses (no AIO, a seccomp filter, the
system's ``aio-max-nr`` spent).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import platform
from typing import Final

import trio

__all__ = ["AioSync", "Unsubmitted", "open_aio"]

_SYSCALLS: Final = {  # io_setup, io_destroy, io_getevents, io_submit
    "x86_64": (206, 207, 208, 209),
    "aarch64": (0, 1, 4, 2),
}
_IOCB_CMD_FDSYNC: Final = 3
_IOCB_FLAG_RESFD: Final = 1


class _Iocb(ctypes.Structure):
    """``struct iocb`` (``linux/aio_abi.h``, little-endian layout)."""

    _fields_ = (
        ("aio_data", ctypes.c_uint64),
        ("aio_key", ctypes.c_uint32),
        ("aio_rw_flags", ctypes.c_int32),
        ("aio_lio_opcode", ctypes.c_uint16),
        ("aio_reqprio", ctypes.c_int16),
        ("aio_fildes", ctypes.c_uint32),
        ("aio_buf", ctypes.c_uint64),
        ("aio_nbytes", ctypes.c_uint64),
        ("aio_offset", ctypes.c_int64),
        ("aio_reserved2", ctypes.c_uint64),
        ("aio_flags", ctypes.c_uint32),
        ("aio_resfd", ctypes.c_uint32),
    )


class _Event(ctypes.Structure):
    """``struct io_event``."""

    _fields_ = (
        ("data", ctypes.c_uint64),
        ("obj", ctypes.c_uint64),
        ("res", ctypes.c_int64),
        ("res2", ctypes.c_int64),
    )


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_NO_WAIT: Final = _Timespec(0, 0)


class AioSync:
    """AIO ``fdatasync`` calls of one Trio run; obtain one from :func:`open_aio`."""

    def __init__(self, context: int, slots: int, numbers: tuple[int, int, int, int]) -> None:
        self._context = ctypes.c_ulong(context)
        self._slots = slots
        self._setup, self._destroy, self._getevents, self._submit = numbers
        self._free: list[int] = []
        self._done: dict[int, int] = {}
        self._tokens = itertools.count(1)
        self._events = (_Event * slots)()
        self.in_flight = 0
        self._closed = False

    async def fdatasync(self, fd: int) -> None:
        """``fdatasync(fd)`` on the kernel's worker; returns once it is done, raises its
        ``OSError``. Not cancellable once submitted (a cancellation arrives after it): the
        caller must learn whether its data is durable."""
        if self._closed:
            raise OSError(errno.EBADF, "the AIO context is closed")
        efd = self._free.pop() if self._free else os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        token = next(self._tokens)
        iocb = _Iocb(
            aio_data=token,
            aio_lio_opcode=_IOCB_CMD_FDSYNC,
            aio_fildes=fd,
            aio_flags=_IOCB_FLAG_RESFD,
            aio_resfd=efd,
        )
        pointers = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(iocb))
        if _syscall(self._submit, self._context, 1, pointers) != 1:
            code = ctypes.get_errno() or errno.EIO
            self._free.append(efd)
            raise Unsubmitted(code, os.strerror(code))
        self.in_flight += 1
        try:
            with trio.CancelScope(shield=True):
                while True:
                    try:
                        os.eventfd_read(efd)
                        break
                    except BlockingIOError:
                        await trio.lowlevel.wait_readable(efd)
        finally:
            self.in_flight -= 1
        self._reap()
        self._free.append(efd)
        result = self._done.pop(token)
        if result < 0:
            raise OSError(-result, os.strerror(-result))

    def _reap(self) -> None:
        """Take every completion in the ring now (no wait) for its owner."""
        while True:
            found = _syscall(
                self._getevents, self._context, 0, self._slots, self._events,
                ctypes.byref(_NO_WAIT),
            )  # fmt: skip
            if found <= 0:
                return
            for event in self._events[:found]:
                self._done[int(event.data)] = int(event.res)
            if found < self._slots:
                return

    def close(self) -> None:
        """Destroy the context (blocking: it waits for calls in flight; call it once none
        is) and close the free ``eventfd``\\ s. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _syscall(self._destroy, self._context)
        for efd in self._free:
            os.close(efd)
        self._free.clear()


class Unsubmitted(OSError):
    """``io_submit`` refused the call (the context is full, or AIO is not there): nothing
    was started; the caller may sync another way."""


def open_aio(slots: int = 128) -> AioSync | None:
    """An AIO context with ``slots`` calls in flight at most, or ``None`` where this
    kernel, architecture or sandbox does not give one."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    context = ctypes.c_ulong(0)
    if _syscall(numbers[0], slots, ctypes.byref(context)) != 0:
        return None
    return AioSync(context.value, slots, numbers)
