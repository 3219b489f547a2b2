# The compiled engine's view of ops.py (Cython's pure-Python mode): operations' state as
# C fields; the methods the drivers and the wire call on every operation as cpdef, which
# Python subclasses (batches, waits, Cluster, Redlock) still override.

cimport cython

from .requests cimport Request


cdef class Operation


# The drift allowance, C constants (read by sure_until on every grant and extend).
cdef double DRIFT, DRIFT_S

cpdef double sure_until(double sent, long long ms)


cdef class Engine:
    cpdef send(self, Request request)
    cpdef wake(self, Operation op)


cdef class Operation:
    cdef public bint abandoned, done, wants_input
    cdef public Py_ssize_t attempts, retries
    cdef public Engine engine
    cdef public object error, replicas, result, waiter

    cpdef prepare(self, Py_ssize_t retries)
    cpdef start(self)
    cpdef answer(self, Request request, list replies)
    cpdef finish(self, result=*)
    cpdef fail(self, error)
    cpdef outcome(self)


cdef class AcquireOne(Operation):
    cdef public object core, name, owner, target
    cdef public bytes key, value
    cdef public Py_ssize_t ms, limit
    cdef public bint fenced
    cdef public double sent

    cpdef lease(self, reply)


cdef class ScriptOne(Operation):
    cdef public object arg, core, kind, lease, target
    cdef public double sent

    @cython.locals(value=bytes)
    cpdef start(self)
