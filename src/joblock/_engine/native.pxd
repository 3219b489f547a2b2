# The compiled engine's view of native.py (Cython's pure-Python mode): the dialect encodes
# every plain release and extend that goes by the server's own commands, in C.

cdef class Dialect:
    cdef public object extend, release

    cpdef encode(self, core, list keys, list values, arg)
