# The compiled engine's view of sync.py (Cython's pure-Python mode): the threaded
# driver's connections and its per-call steps as C fields and calls.

cimport cython

from .ops cimport Engine, Operation
from .requests cimport Request
from .wire cimport Wire


cdef class Connection:
    cdef public double idle_since, last_progress, recheck_at
    cdef public bint plain, retire, writing
    cdef public list inbox
    cdef public object receive, settings, sock, state, target
    cdef public Wire wire

    cpdef recv(self)
    cpdef bytes take(self)
    cpdef send(self, data)


cdef class _State(Engine):
    cdef public Py_ssize_t generation
    cdef public object core, settings_for, resolver, mutex, hold, let_go, leader, timer_seq
    cdef public Operation heir
    cdef public object wake_r, wake_w
    cdef public bint multi, polling, poked
    cdef public dict conns, listeners
    cdef public set refusing, background
    cdef public object reloads, caught
    cdef public list list, waiting, due, timers
    cdef public Py_ssize_t woken

    @cython.locals(conn=Connection, now=double)
    cpdef send(self, Request request)
    cpdef wake(self, Operation op)
    cpdef wake_next(self)
    cpdef rouse(self, Operation op)

    @cython.locals(conn=Connection, unled=bint)
    cpdef run(self, Operation op)
    cpdef alone(self, Operation op, Connection conn, me)
    cpdef handover(self)

    cpdef retake(self)

    @cython.locals(conn=Connection)
    cpdef recover(self, me, failure)
    cpdef wake_all(self)
    cpdef lose(self, Connection conn, failure, str what)

    @cython.locals(conn=Connection, leading=bint)
    cpdef write(self, me)
    cpdef output(self, Connection conn)

    @cython.locals(conn=Connection)
    cpdef read_once(self)
    cpdef receive(self, Connection conn)
    cpdef received(self, Connection conn, failure, bint first=*)

    @cython.locals(now=double)
    cpdef feed(self, Connection conn, data, bint first=*)
    cpdef kill(self, Connection conn, error, bint retryable)


cdef class Driver:
    cdef object _core, _settings_for, _resolver
    cdef bint _multi
    cdef _State _state

    @cython.locals(state=_State)
    cpdef run(self, Operation op)
