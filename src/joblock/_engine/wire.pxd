# The compiled engine's view of wire.py (Cython's pure-Python mode): a connection's
# state as C fields and the steps every request takes as C calls.

cimport cython

from .ops cimport Operation
from .requests cimport Request


cdef class Wire:
    cdef object _core, _error_positions, _load_error, _reader, _settings, _take
    cdef readonly object _dialect  # (the tests look at it)
    cdef set _refusing
    cdef readonly object _inflight  # (the tests look at it)
    cdef object _held
    cdef list _out, _unwaited
    cdef Py_ssize_t _outstanding, _seq, _taken_seq, _load_seq
    cdef bint _pairs, _primary
    cdef public bint interruptible
    cdef public object state

    @cython.locals(op=Operation)
    cpdef submit(self, Request request)
    cpdef bint busy(self)
    cpdef Py_ssize_t unsent(self)
    cpdef Py_ssize_t outstanding(self)

    @cython.locals(out=list)
    cpdef output(self)

    @cython.locals(request=Request)
    cpdef bint quick(self, bytes data)

    @cython.locals(request=Request)
    cpdef feed(self, data)
    cpdef _push(self, Request request)
    cpdef _write(self, Request request)
    cpdef bint _owe(self, Request request, Operation op)

    @cython.locals(replies=list, op=Operation)
    cpdef _complete(self, Request request)


@cython.locals(i=Py_ssize_t)
cpdef list _undone(list replies)
