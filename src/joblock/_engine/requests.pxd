# The compiled engine's view of requests.py (Cython's pure-Python mode): the fields the
# wire reads for every request, as C fields of extension types.

from .native cimport Dialect

cdef class Request:
    cdef public object op, target, payload, parent
    cdef public list got
    cdef public Py_ssize_t n, seq
    cdef public bint scripted, merges, exclusive, nx_get, fast

    cpdef list merge(self, list got)
    cpdef fit(self, dialect)


cdef class Single(Request):
    pass


cdef class SingleAcquire(Single):
    cdef public bytes key, value


cdef class CompareOne(Single):
    cdef public object core, arg
    cdef public bytes key, value, sha
    cdef public bint native

    cpdef fit(self, dialect)


cpdef tuple fast_payload(core, Dialect dialect, sha, keys, values, arg)
