# The compiled engine's view of aio.py (Cython's pure-Python mode): the asyncio
# driver's protocol and per-call steps as C fields and calls.

cimport cython

from .ops cimport Engine, Operation
from .requests cimport Request
from .wire cimport Wire


cdef class _LoopState


cdef class Waiter:
    cdef public object _loop, callback, context, message
    cdef public bint _asyncio_future_blocking
    cdef int state

    cpdef bint finish(self)
    cpdef wake_task(self)


cdef class Connection:
    cdef public _LoopState state
    cdef public object target, settings, transport, watchdog
    cdef public Wire wire
    cdef public bint dead, flush_scheduled
    cdef public double last_progress, recheck_at


cdef class _LoopState(Engine):
    cdef public object loop, core, settings_for, resolver
    cdef public Py_ssize_t generation
    cdef public dict conns, background, listeners
    cdef public set refusing, connecting
    cdef public object reloads
    cdef public list woken
    cdef public bint waking, inline

    @cython.locals(conn=Connection, wire=Wire, idle=bint)
    cpdef send(self, Request request)

    @cython.locals(waiter=Waiter)
    cpdef proceed(self, Operation op, bint start=*)

    @cython.locals(waiter=Waiter)
    cpdef wake(self, Operation op)

    @cython.locals(waiter=Waiter, woken=list, i=Py_ssize_t)
    cpdef run_woken(self)

    cpdef flush(self, Connection conn)

    @cython.locals(other=Connection)
    cpdef feed(self, Connection conn, data)

    @cython.locals(other=Connection)
    cpdef kill(self, Connection conn, error, bint retryable)


cdef class Driver:
    cdef object _core, _settings_for, _resolver
    cdef public _LoopState _state

    cpdef _LoopState _current(self)
