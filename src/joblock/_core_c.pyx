# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""joblock's compiled core: the twin of ``_core_py.py``.

Same functions, same results, same errors; this one builds keys, encodes command
windows and scans replies in C loops, so a window of a thousand locks costs the
client little next to what it costs Redis.
"""

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_FromLongLong
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from cpython.unicode cimport PyUnicode_Check
from libc.string cimport memchr, memcmp, memcpy, memmove

import hashlib
import os
import time

from . import _scripts
from ._slot_tags import COUNTER as _COUNTER, TAGS as _TAGS
from .errors import LockLost, ProtocolError, ReplyError

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL
    object PyLong_FromString(const char* s, char** pend, int base)
    ctypedef struct PyTypeObject:
        object (*tp_repr)(object)
    PyTypeObject PyLong_Type
    PyTypeObject PyFloat_Type
    long long PyLong_AsLongLongAndOverflow(object o, int* overflow) except? -1
    bint PyUnicode_IS_COMPACT_ASCII(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    void* PyUnicode_DATA(object o)

MAX_KEY_BYTES = 65536
MAX_IDENTIFIER_BYTES = 200
MAX_DEPTH = 32

cdef enum:
    C_MAX_KEY_BYTES = 65536
    C_MAX_IDENTIFIER_BYTES = 200
    C_MAX_DEPTH = 32
    C_RANDOM_POOL = 4096

cdef object _blake2b = hashlib.blake2b
cdef object _urandom = os.urandom
cdef object _monotonic = time.monotonic
cdef bytes _OK = b"OK"
cdef bytes _MARK = _scripts.MARK  # a waiter's mark on a plain lock's value
cdef object _INCOMPLETE = object()
cdef const char* _HEX = b"0123456789ABCDEF"
cdef const char* _hex_lower = b"0123456789abcdef"

# 1 where a byte is written as %XX: the key grammar's own bytes, controls, and
# (in bytes arguments only) everything >= 0x80. Mirrors _core_py's tables.
cdef unsigned char _TEXT_ESC[256]
cdef unsigned char _BYTES_ESC[256]


cdef void _init_tables() noexcept:
    cdef int c
    cdef const char* special = b"%-:{}'()[],=# "
    for c in range(256):
        _TEXT_ESC[c] = c < 0x20 or c == 0x7F
        _BYTES_ESC[c] = _TEXT_ESC[c] or c >= 0x80
    for c in range(14):
        _TEXT_ESC[<unsigned char>special[c]] = 1
        _BYTES_ESC[<unsigned char>special[c]] = 1


_init_tables()


# A growable byte buffer for building keys and commands without Python objects.
cdef struct Buf:
    char* data
    Py_ssize_t len
    Py_ssize_t cap


cdef int _reserve(Buf* b, Py_ssize_t extra) except -1:
    cdef Py_ssize_t need = b.len + extra
    cdef Py_ssize_t cap
    cdef char* data
    if need <= b.cap:
        return 0
    cap = b.cap * 2 if b.cap else 256
    while cap < need:
        cap *= 2
    data = <char*>PyMem_Realloc(b.data, cap)
    if data == NULL:
        raise MemoryError()
    b.data = data
    b.cap = cap
    return 0


cdef inline int _put(Buf* b, const char* s, Py_ssize_t n) except -1:
    if n == 0:
        return 0  # s may be NULL (an empty Buf's data), which memcpy must never get
    if b.len + n > b.cap:
        _reserve(b, n)
    memcpy(b.data + b.len, s, n)
    b.len += n
    return 0


cdef inline int _putc(Buf* b, char c) except -1:
    if b.len + 1 > b.cap:
        _reserve(b, 1)
    b.data[b.len] = c
    b.len += 1
    return 0


cdef int _put_escaped(Buf* b, const unsigned char* s, Py_ssize_t n, unsigned char* table) except -1:
    cdef Py_ssize_t i
    cdef unsigned char c
    _reserve(b, 3 * n)
    for i in range(n):
        c = s[i]
        if table[c]:
            b.data[b.len] = b"%"
            b.data[b.len + 1] = _HEX[c >> 4]
            b.data[b.len + 2] = _HEX[c & 15]
            b.len += 3
        else:
            b.data[b.len] = <char>c
            b.len += 1
    return 0


cdef int _put_obj(Buf* b, object s) except -1:
    # s is a str of ASCII (a repr of a number)
    cdef Py_ssize_t n
    cdef const char* p = PyUnicode_AsUTF8AndSize(s, &n)
    return _put(b, p, n)


cdef Py_ssize_t _digits(long long v, char* out) noexcept:
    # Decimal digits of v into out (at most 20 chars); returns their count.
    cdef char tmp[24]
    cdef Py_ssize_t n = 0, i
    # Negated as unsigned: -v overflows (undefined in C) for v = -(2**63).
    cdef unsigned long long u = 0ULL - <unsigned long long>v if v < 0 else <unsigned long long>v
    while True:
        tmp[n] = <char>(48 + u % 10)
        n += 1
        u //= 10
        if u == 0:
            break
    if v < 0:
        tmp[n] = b"-"
        n += 1
    for i in range(n):
        out[i] = tmp[n - 1 - i]
    return n


cdef int _put_int(Buf* b, long long v) except -1:
    cdef char tmp[24]
    return _put(b, tmp, _digits(v, tmp))


cdef str _where(Py_ssize_t outer, Py_ssize_t inner, object name):
    if name is not None:
        return f"kwargs[{name!r}]"
    if outer >= 0:
        return f"arg_tuples[{outer}][{inner}]"
    return f"args[{inner}]"


cdef const char* _utf8(object s, Py_ssize_t* n, Py_ssize_t outer, Py_ssize_t inner, object name) except NULL:
    try:
        return PyUnicode_AsUTF8AndSize(s, n)
    except UnicodeEncodeError:
        where = "job" if outer == -2 else _where(outer, inner, name)
        raise ValueError(f"{where}: str with lone surrogates cannot be encoded as UTF-8") from None


cdef bint _reserved(const unsigned char* s, Py_ssize_t n) noexcept:
    if n == 4:
        return memcmp(s, b"None", 4) == 0 or memcmp(s, b"True", 4) == 0
    if n == 5:
        return memcmp(s, b"False", 5) == 0
    if n == 3:
        return memcmp(s, b"nan", 3) == 0 or memcmp(s, b"inf", 3) == 0
    return False


cdef int _text(Buf* b, object s, Py_ssize_t outer, Py_ssize_t inner, object name) except -1:
    cdef Py_ssize_t n
    cdef const unsigned char* p = <const unsigned char*>_utf8(s, &n, outer, inner, name)
    cdef bint quote = n == 0 or (48 <= p[0] <= 57) or _reserved(p, n)
    if quote:
        _putc(b, b"'")
    _put_escaped(b, p, n, _TEXT_ESC)
    if quote:
        _putc(b, b"'")
    return 0


cdef int _token(Buf* b, object value, Py_ssize_t outer, Py_ssize_t inner, object name, int depth) except -1:
    cdef int overflow = 0
    cdef long long v
    cdef Py_ssize_t i, n
    if value is None:
        return _put(b, b"None", 4)
    if value is True:
        return _put(b, b"True", 4)
    if value is False:
        return _put(b, b"False", 5)
    if PyUnicode_Check(value):
        return _text(b, value, outer, inner, name)
    if isinstance(value, int):
        v = PyLong_AsLongLongAndOverflow(value, &overflow)
        if overflow == 0:
            return _put_int(b, v)
        return _put_obj(b, PyLong_Type.tp_repr(value))
    if isinstance(value, float):
        return _put_obj(b, PyFloat_Type.tp_repr(value))
    if isinstance(value, bytes):
        _put(b, b"b'", 2)
        _put_escaped(b, <const unsigned char*>PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value), _BYTES_ESC)
        return _putc(b, b"'")
    if depth >= C_MAX_DEPTH:
        raise ValueError(f"{_where(outer, inner, name)}: arguments nest deeper than {C_MAX_DEPTH} levels")
    if isinstance(value, (tuple, list)):
        _putc(b, b"[")
        n = len(value)
        for i in range(n):
            if i:
                _putc(b, b",")
            _token(b, value[i], outer, inner, name, depth + 1)
        return _putc(b, b"]")
    if isinstance(value, dict):
        _putc(b, b"(")
        _put_pairs(b, value, outer, inner, name, depth + 1)
        return _putc(b, b")")
    raise TypeError(
        f"{_where(outer, inner, name)}: cannot build a lock key from {type(value).__name__!r}; "
        "pass str, int, "
        "float, bool, None, bytes, or a list, tuple or dict of those (or give the job an identifier)"
    )


cdef int _put_pairs(
    Buf* b, object mapping, Py_ssize_t outer, Py_ssize_t inner, object name, int depth
) except -1:
    # Pairs are sorted by their rendering, so the key does not depend on dict order.
    cdef Buf item = Buf(NULL, 0, 0)
    cdef list pairs = []
    try:
        for k, v in mapping.items():
            item.len = 0
            _token(&item, k, outer, inner, name, depth)
            _putc(&item, b"=")
            _token(&item, v, outer, inner, name, depth)
            pairs.append(PyBytes_FromStringAndSize(item.data, item.len))
    finally:
        PyMem_Free(item.data)
    pairs.sort()
    joined = b",".join(pairs)
    return _put(b, PyBytes_AS_STRING(joined), PyBytes_GET_SIZE(joined))


cdef int _identifier(Buf* b, object args, object kwargs, Py_ssize_t outer) except -1:
    # Appends ":" + identifier to b, unless the identifier is empty.
    cdef Py_ssize_t start = b.len, i, n = len(args)
    _putc(b, b":")
    for i in range(n):
        if i:
            _putc(b, b"-")
        _token(b, args[i], outer, i, None, 0)
    if kwargs:
        for k, v in sorted(kwargs.items()):
            if b.len > start + 1:
                _putc(b, b"-")
            _text(b, k, outer, 0, k)
            _putc(b, b"=")
            _token(b, v, outer, 0, k, 0)
    if b.len == start + 1:
        b.len = start
    elif b.len - start - 1 > C_MAX_IDENTIFIER_BYTES:
        digest = _blake2b(PyBytes_FromStringAndSize(b.data + start + 1, b.len - start - 1), digest_size=16)
        b.len = start + 1
        _putc(b, b"#")
        _put_obj(b, digest.hexdigest())
    return 0


cdef int _head(Buf* b, bytes prefix, object job) except -1:
    cdef Py_ssize_t n
    cdef const unsigned char* p
    if type(job) is not str:
        raise TypeError(f"job must be a str, not {type(job).__name__}")
    if not job:
        raise ValueError("job must not be empty")
    p = <const unsigned char*>_utf8(job, &n, -2, 0, None)
    if PyBytes_GET_SIZE(prefix):
        _put(b, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix))
        _putc(b, b":")
    return _put_escaped(b, p, n, _TEXT_ESC)


def build_key(bytes prefix, job, tuple args, kwargs):
    """``prefix:job:identifier``; the identifier renders args then sorted kwargs, joined by ``-``."""
    cdef Buf b = Buf(NULL, 0, 0)
    try:
        _head(&b, prefix, job)
        _identifier(&b, args, kwargs, -1)
        return PyBytes_FromStringAndSize(b.data, b.len)
    finally:
        PyMem_Free(b.data)


def build_keys(bytes prefix, job, list arg_tuples, Py_ssize_t start):
    """The keys of ``dedupe``: one per argument tuple; ``start`` numbers them in errors."""
    cdef Buf b = Buf(NULL, 0, 0)
    cdef Py_ssize_t head, i, n = PyList_GET_SIZE(arg_tuples)
    cdef list keys = [None] * n
    cdef object args
    try:
        _head(&b, prefix, job)
        head = b.len
        for i in range(n):
            args = <object>PyList_GET_ITEM(arg_tuples, i)
            if type(args) is not tuple and type(args) is not list:
                raise TypeError(
                    f"arg_tuples[{start + i}] must be a tuple of arguments, not {type(args).__name__}"
                )
            b.len = head
            _identifier(&b, args, None, start + i)
            keys[i] = PyBytes_FromStringAndSize(b.data, b.len)
        return keys
    finally:
        PyMem_Free(b.data)


cdef bytes _as_key(object key, object where):
    cdef Py_ssize_t n
    cdef const char* p
    if type(key) is bytes:
        raw = key
    elif PyUnicode_Check(key):
        try:
            p = PyUnicode_AsUTF8AndSize(key, &n)
        except UnicodeEncodeError:
            raise ValueError(f"{where}: str with lone surrogates cannot be encoded as UTF-8") from None
        raw = PyBytes_FromStringAndSize(p, n)
    elif isinstance(key, bytes):
        raw = bytes(key)
    else:
        raise TypeError(f"{where} must be str or bytes, not {type(key).__name__}")
    n = PyBytes_GET_SIZE(raw)
    if n == 0:
        raise ValueError(f"{where} must not be empty")
    if n > C_MAX_KEY_BYTES:
        raise ValueError(f"{where} is {n} bytes long; the limit is {C_MAX_KEY_BYTES}")
    return raw


def as_key(key, where="key"):
    """A lock key given by the user as str (UTF-8) or bytes (as is), checked."""
    return _as_key(key, where)


def as_keys(list keys, Py_ssize_t start):
    cdef Py_ssize_t i, n = PyList_GET_SIZE(keys), size
    cdef list out = [None] * n
    cdef object key
    cdef const char* p
    for i in range(n):
        key = <object>PyList_GET_ITEM(keys, i)
        # Fast paths for the common keys; anything unusual (or wrong) takes the
        # checked path, which names the key in its error.
        if type(key) is bytes:
            size = PyBytes_GET_SIZE(key)
            if 0 < size <= C_MAX_KEY_BYTES:
                out[i] = key
                continue
        elif PyUnicode_Check(key) and PyUnicode_IS_COMPACT_ASCII(key):
            size = PyUnicode_GET_LENGTH(key)
            if 0 < size <= C_MAX_KEY_BYTES:
                p = <const char*>PyUnicode_DATA(key)
                out[i] = PyBytes_FromStringAndSize(p, size)
                continue
        out[i] = _as_key(key, f"keys[{start + i}]")
    return out


cdef unsigned short _CRC16[256]


cdef void _init_crc16() noexcept:
    cdef int byte, _bit
    cdef unsigned int crc
    for byte in range(256):
        crc = <unsigned int>byte << 8
        for _bit in range(8):
            crc = ((crc << 1) ^ 0x1021 if crc & 0x8000 else crc << 1) & 0xFFFF
        _CRC16[byte] = <unsigned short>crc


_init_crc16()
SLOTS = 16384


cdef inline unsigned int _crc16(const unsigned char* s, Py_ssize_t n) noexcept:
    cdef unsigned int crc = 0
    cdef Py_ssize_t i
    for i in range(n):
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ s[i]) & 0xFF]
    return crc


cdef int _slot(object key, object name) except -1:
    cdef const unsigned char* s
    cdef Py_ssize_t n, i, start = -1, end = -1
    if not isinstance(key, bytes):
        raise TypeError(f"{name} must be bytes, not {type(key).__name__}")
    s = <const unsigned char*>PyBytes_AS_STRING(key)
    n = PyBytes_GET_SIZE(key)
    for i in range(n):
        if s[i] == 123:  # {
            start = i
            break
    if start >= 0:
        for i in range(start + 1, n):
            if s[i] == 125:  # }
                end = i
                break
        if end > start + 1:
            return _crc16(s + start + 1, end - start - 1) & 16383
    return _crc16(s, n) & 16383


def crc16(data):
    """CRC16-XMODEM (polynomial 0x1021, initial 0), the checksum Redis Cluster hashes keys with."""
    if not isinstance(data, bytes):
        raise TypeError(f"data must be bytes, not {type(data).__name__}")
    return _crc16(<const unsigned char*>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))


def key_slot(key):
    """The Redis Cluster hash slot of ``key`` (0..16383), hash tags included."""
    return _slot(key, "key")


def fence_key(bytes key):
    """The fencing counter of ``key``: the one of its Redis Cluster hash slot (see the
    pure core's)."""
    cdef Py_ssize_t slot, start = key.find(b"{")
    cdef bint tagged = start >= 0 and key.find(b"}", start + 1) > start + 1
    if not tagged and b"}" in key:
        raise ValueError(f"fence=True needs a key without an unmatched '}}': {key!r}")
    slot = 3 * _slot(key, "key")
    return _COUNTER % _TAGS[slot:slot + 3]


def key_slots(keys):
    """``key_slot`` of each key, in order."""
    cdef list klist
    cdef Py_ssize_t i, n
    cdef list out
    if type(keys) is not list:
        raise TypeError(f"keys must be a list, not {type(keys).__name__}")
    klist = <list>keys
    n = PyList_GET_SIZE(klist)
    out = [None] * n
    for i in range(n):
        out[i] = _slot(<object>PyList_GET_ITEM(klist, i), "key")
    return out


# Random bytes for a few tokens at a time come from a pool the OS's CSPRNG fills
# C_RANDOM_POOL bytes at once (a batch draws its own): each read is a system call that
# lets go of the GIL, which with many threads acquiring is a hand-off to another thread
# per acquire. Under the GIL no other thread runs between the refill and the draw. The
# pool is its process's: a forked child refills (its parent draws the same bytes), also
# when forked without Python's at-fork hooks (uWSGI's default), as libc's fork() runs
# pthread_atfork's handlers whoever calls it. (A handler, not a getpid() per draw: that
# is a system call per acquire.)
cdef bytes _pool = b""
cdef Py_ssize_t _drawn = 0
cdef bint _pool_forked = False

cdef extern from *:
    """
    #ifdef _WIN32
    /* No fork() there: nothing to watch for. */
    static int joblock_at_fork(void (*child)(void)) { (void)child; return 0; }
    #else
    #include <pthread.h>
    static int joblock_at_fork(void (*child)(void)) { return pthread_atfork(NULL, NULL, child); }
    #endif
    """
    int joblock_at_fork(void (*child)() noexcept nogil)


cdef void _forked() noexcept nogil:
    global _pool_forked
    _pool_forked = True


if joblock_at_fork(_forked) != 0:
    raise OSError("pthread_atfork failed: a forked child could not tell its tokens' pool is its parent's")


def new_values(Py_ssize_t n, bytes holder):
    """``n`` lock values: 128 random bits from the OS's CSPRNG in hex, then the holder."""
    global _pool, _drawn, _pool_forked
    cdef bytes rnd
    cdef Py_ssize_t at = 0
    if n < 0:
        raise ValueError(f"n must not be negative, not {n}")
    if 16 * n > C_RANDOM_POOL // 4:
        rnd = _urandom(16 * n)
    else:
        if _drawn + 16 * n > PyBytes_GET_SIZE(_pool) or _pool_forked:
            _pool, _drawn, _pool_forked = _urandom(C_RANDOM_POOL), 0, False
        rnd, at = _pool, _drawn
        _drawn += 16 * n
    cdef const unsigned char* r = <const unsigned char*>PyBytes_AS_STRING(rnd) + at
    cdef Py_ssize_t hlen = PyBytes_GET_SIZE(holder), i, j
    cdef list out = [None] * n
    cdef bytes value
    cdef char* p
    for i in range(n):
        value = PyBytes_FromStringAndSize(NULL, 32 + hlen)
        p = PyBytes_AS_STRING(value)
        for j in range(16):
            p[2 * j] = _hex_lower[r[16 * i + j] >> 4]
            p[2 * j + 1] = _hex_lower[r[16 * i + j] & 15]
        memcpy(p + 32, PyBytes_AS_STRING(holder), hlen)
        out[i] = value
    return out


cdef inline int _bulk(Buf* b, const char* s, Py_ssize_t n) except -1:
    cdef char tmp[24]
    cdef Py_ssize_t d = _digits(n, tmp)
    _reserve(b, n + d + 5)
    b.data[b.len] = b"$"
    memcpy(b.data + b.len + 1, tmp, d)
    b.len += d + 1
    b.data[b.len] = b"\r"
    b.data[b.len + 1] = b"\n"
    memcpy(b.data + b.len + 2, s, n)
    b.len += n + 2
    b.data[b.len] = b"\r"
    b.data[b.len + 1] = b"\n"
    b.len += 2
    return 0


cdef inline int _bulk_bytes(Buf* b, bytes s) except -1:
    return _bulk(b, PyBytes_AS_STRING(s), PyBytes_GET_SIZE(s))


cdef bytes _finish(Buf* b):
    try:
        return PyBytes_FromStringAndSize(b.data, b.len)
    finally:
        PyMem_Free(b.data)
        b.data = NULL


def encode_command(args):
    """One command in RESP, its arguments given as bytes, str (UTF-8) or int."""
    cdef list parts = []
    for arg in args:
        if type(arg) is str:
            arg = arg.encode()
        elif type(arg) is int:
            arg = b"%d" % arg
        elif type(arg) is not bytes:
            raise TypeError(f"command arguments must be bytes, str or int, not {type(arg).__name__}")
        parts.append(arg)
    cdef Buf b = Buf(NULL, 0, 0)
    _putc(&b, b"*")
    _put_int(&b, len(parts))
    _put(&b, b"\r\n", 2)
    for arg in parts:
        _bulk_bytes(&b, arg)
    return _finish(&b)


cdef int _check_window(list keys, list values) except -1:
    if PyList_GET_SIZE(keys) != PyList_GET_SIZE(values):
        raise ValueError("keys and values differ in length")
    return 0


cdef int _bulk_arg(Buf* b, object arg) except -1:
    # An int or bytes command argument, as encode_command takes them.
    cdef char tmp[24]
    cdef int overflow = 0
    cdef long long v
    if type(arg) is int:
        v = PyLong_AsLongLongAndOverflow(arg, &overflow)
        if overflow == 0:
            return _bulk(b, tmp, _digits(v, tmp))
        arg = str(arg).encode()
    elif type(arg) is not bytes:
        raise TypeError(f"command arguments must be bytes or int, not {type(arg).__name__}")
    return _bulk_bytes(b, arg)


def encode_acquire(list keys, list values, long long ms, sha, tuple extra=()):
    """A window of ``SET key value NX PX ms GET``, or with ``sha`` of a script's
    ``EVALSHA sha 2 key fence_key value ms *extra`` (the fenced-acquire script, or the
    counting-lock script with its further arguments)."""
    cdef Buf b = Buf(NULL, 0, 0)
    cdef Buf head = Buf(NULL, 0, 0)
    cdef Buf tail = Buf(NULL, 0, 0)
    cdef Py_ssize_t i, n = PyList_GET_SIZE(keys)
    cdef char tmp[24]
    cdef Py_ssize_t d = _digits(ms, tmp)
    cdef bytes key
    _check_window(keys, values)
    if sha is None and extra:
        raise ValueError("extra arguments go to a script: give its sha")
    try:
        _bulk(&tail, tmp, d)
        if sha is not None:
            _putc(&head, b"*")
            _put_int(&head, 7 + len(extra))
            _put(&head, b"\r\n$7\r\nEVALSHA\r\n", 15)
            _bulk_bytes(&head, sha)
            _put(&head, b"$1\r\n2\r\n", 7)
            for arg in extra:
                _bulk_arg(&tail, arg)
        for i in range(n):
            key = <bytes>PyList_GET_ITEM(keys, i)
            if sha is None:
                _put(&b, b"*7\r\n$3\r\nSET\r\n", 13)
                _bulk_bytes(&b, key)
                _bulk_bytes(&b, <bytes>PyList_GET_ITEM(values, i))
                _put(&b, b"$2\r\nNX\r\n$2\r\nPX\r\n", 16)
                _put(&b, tail.data, tail.len)
                _put(&b, b"$3\r\nGET\r\n", 9)
            else:
                _put(&b, head.data, head.len)
                _bulk_bytes(&b, key)
                _bulk_bytes(&b, fence_key(key))
                _bulk_bytes(&b, <bytes>PyList_GET_ITEM(values, i))
                _put(&b, tail.data, tail.len)
        return _finish(&b)
    finally:
        PyMem_Free(head.data)
        PyMem_Free(tail.data)
        PyMem_Free(b.data)


cdef bytes _compare(
    const char* head, Py_ssize_t head_len, list keys, list values, bytes middle, const char* tail,
    Py_ssize_t tail_len, bint twice
):
    cdef Buf b = Buf(NULL, 0, 0)
    cdef Py_ssize_t i, n = PyList_GET_SIZE(keys)
    cdef bytes value
    _check_window(keys, values)
    try:
        _reserve(&b, n * (head_len + PyBytes_GET_SIZE(middle) + tail_len + 120))
        for i in range(n):
            value = <bytes>PyList_GET_ITEM(values, i)
            _put(&b, head, head_len)
            _bulk_bytes(&b, <bytes>PyList_GET_ITEM(keys, i))
            if twice:
                _bulk_bytes(&b, value)
            _put(&b, PyBytes_AS_STRING(middle), PyBytes_GET_SIZE(middle))
            _bulk_bytes(&b, value)
            _put(&b, tail, tail_len)
        return _finish(&b)
    finally:
        PyMem_Free(b.data)


def encode_compare(bytes head, list keys, list values, bytes middle, bytes tail, bint twice):
    """A window of ``head key [value] middle value tail`` per key (``value`` twice with
    ``twice``): a compare-and-act command, the server's own (DELIFEQ, SET IFEQ) or EVALSHA."""
    return _compare(
        PyBytes_AS_STRING(head), PyBytes_GET_SIZE(head), keys, values, middle, PyBytes_AS_STRING(tail),
        PyBytes_GET_SIZE(tail), twice,
    )


def encode_evalsha(bytes sha, list keys, list values, arg):
    """A window of ``EVALSHA sha 1 key value [arg]``: release, extend and remaining."""
    cdef Buf head = Buf(NULL, 0, 0)
    cdef Buf tail = Buf(NULL, 0, 0)
    cdef char tmp[24]
    try:
        _put(&head, b"*5\r\n$7\r\nEVALSHA\r\n" if arg is None else b"*6\r\n$7\r\nEVALSHA\r\n", 17)
        _bulk_bytes(&head, sha)
        _put(&head, b"$1\r\n1\r\n", 7)
        if arg is not None:
            _bulk(&tail, tmp, _digits(<long long>arg, tmp))
        return _compare(head.data, head.len, keys, values, b"", tail.data, tail.len, False)
    finally:
        PyMem_Free(head.data)
        PyMem_Free(tail.data)


# Leases are not tracked by the cyclic GC: a dispatcher holds millions, and tracking
# them made each grant several times slower. Nothing a lease refers to (its Locks,
# bytes, str, int, a metrics stamp) refers back to leases, so they cannot form a cycle.
@cython.no_gc
cdef class Lease:
    """A granted lock: its key, its token, and (with ``fence=True``) its fencing number.

    ``release()`` returns False when the lock had expired or been taken before the
    release (resque-lock-timeout's ``lock_expired_before_release``); ``extend(ttl)``
    returns True while the lock is still ours. Usable as a context manager that
    releases on exit.
    """

    cdef public object _owner
    cdef public bytes _key
    cdef public object _name
    cdef public bytes _value
    cdef public object _fence
    cdef public bint _held
    # The monotonic time until which the lease is sure of its lock (0.0: not known, for
    # a lease adopted from another process until an extend confirms it); why it was
    # lost (None while it holds); and what to call when it is lost (joblock.lost's guard).
    cdef public double _deadline
    cdef public object _lost
    cdef public object _watch
    # Whether a release handed it the lock: its release and extend then go by the scripts
    # at once (joblock._scripts, MARK). A lock waited for is likely waited for again, and a
    # waiter that queues after the hand-off marks the lock: the plain command would find
    # the mark, and a second round trip, the script's, would follow.
    cdef public bint _handed_over
    # Set by joblock.metrics while instrumented (grant time, job); None otherwise.
    cdef public object _stamp

    def __init__(self):
        raise TypeError("leases come from Locks.acquire and its kin")

    @property
    def key(self):
        """The key as given (str or bytes); built keys are str."""
        return self._key.decode() if self._name is None else self._name

    @property
    def token(self):
        """The lock's value in Redis: a fresh 128-bit token, then the holder's host and pid
        (``~`` before them for a counting lock's holder, ``#`` and its fence after)."""
        return self._value

    @property
    def fence(self):
        """The fencing number of a lease acquired with ``fence=True``, else None."""
        return self._fence

    @property
    def held(self):
        """False once released, or once an extend found the lock gone (local knowledge)."""
        return self._held

    # With an AsyncLocks owner these return awaitables: ``await lease.release()``.

    def release(self):
        """True once released; False when it had expired or been taken (or was released)."""
        return self._owner._release(self)

    def extend(self, ttl, *, min_replicas=None):
        """True while the lock is ours (its ttl is now ``ttl``), else False. With
        ``min_replicas`` (default: the client's), only once that many replicas
        acknowledged it; else the lock is released and ReplicationError raised."""
        return self._owner._extend(self, ttl, min_replicas)

    def remaining(self):
        """Seconds left on the lock per Redis while it is ours, else None."""
        return self._owner._remaining(self)

    @property
    def lost(self):
        """Set once the lease cannot be sure it holds its lock: a ``threading.Event``-like
        object (``is_set()``, ``wait(timeout)``), awaitable with an asyncio client."""
        return self._owner._lost_signal(self)

    def check(self):
        """Raises LockLost, naming the key and why, once the lease is lost."""
        cause = loss(self)
        if cause is not None:
            raise LockLost(self.key, cause)

    def valid_for(self):
        """Seconds the lease is sure to hold its lock, by its local deadline (0.0 once lost)."""
        if loss(self) is not None:
            return 0.0
        return max(0.0, self._deadline - _monotonic())

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self._owner._exit(self)

    def __repr__(self):
        state = "held" if self._held else "released"
        fence = "" if self._fence is None else f" fence={self._fence}"
        return f"<Lease {self.key!r} {state}{fence}>"


def make_leases(owner, list keys, names, list values, list replies, double deadline):
    """Leases (or None where busy) from an acquire window's replies, each sure of its
    lock until ``deadline`` (monotonic seconds).

    Error replies stay in place as ReplyError objects; the count of them is returned
    so the caller can reload a script or give up.
    """
    cdef Py_ssize_t i, n = PyList_GET_SIZE(replies)
    cdef list out = [None] * n
    cdef Py_ssize_t errors = 0
    cdef object reply
    for i in range(n):
        reply = <object>PyList_GET_ITEM(replies, i)
        if reply is None:
            continue
        if type(reply) is ReplyError:
            errors += 1
            out[i] = reply
            continue
        out[i] = _lease(
            owner, <bytes>PyList_GET_ITEM(keys, i), None if names is None else names[i],
            <bytes>PyList_GET_ITEM(values, i), reply, deadline,
        )
    return out, errors


def make_lease(owner, bytes key, name, bytes value, reply, double deadline):
    """The lease a single acquire's grant (``reply``: b"OK" or a fencing number) makes."""
    return _lease(owner, key, name, value, reply, deadline)


cdef Lease _lease(owner, bytes key, name, bytes value, reply, double deadline):
    cdef Lease lease = Lease.__new__(Lease)
    lease._owner = owner
    lease._key = key
    lease._name = name
    lease._value = value
    lease._fence = reply if type(reply) is int else None
    lease._held = True
    lease._deadline = deadline
    lease._lost = None
    lease._watch = None
    lease._handed_over = False
    return lease


cpdef lose(Lease lease, str cause):
    """Marks ``lease`` lost for ``cause`` (the first cause stays) and tells its watch."""
    if lease._lost is None:
        lease._lost = cause
        if lease._watch is not None:
            lease._watch(lease)


cdef object _loss(Lease lease, double now):
    if lease._lost is None and 0.0 < lease._deadline <= now:
        lose(lease, "deadline")
    return lease._lost


def loss(Lease lease):
    """Why ``lease`` is lost, or None while it is sure of its lock; a deadline found
    passed is marked as its loss (a lease once lost stays lost)."""
    return _loss(lease, _monotonic())


cdef bint _confirm(Lease lease, object reply, double deadline, bint release, double now) except -1:
    # ``now`` < 0: the clock is read only if the verdict needs it (an extend done).
    cdef bint ok = type(reply) is int and reply > 0
    if release:
        lease._held = False
        lose(lease, "ended" if ok else "taken" if reply == -1 else "expired")
    elif not ok:
        lease._held = False
        lose(lease, "taken" if reply == -1 else "expired")
    elif _loss(lease, _monotonic() if now < 0.0 else now) is None:
        lease._deadline = deadline
        if lease._watch is not None:  # the kernel's stop of its "exit" blocks moves too
            lease._watch.moved(lease)
    return ok


def confirm(Lease lease, reply, deadline):
    """What a release's (``deadline`` None) or extend's reply (1 done, 0 gone, -1 another's)
    says of ``lease``: True when done. An extend done in time moves its deadline to
    ``deadline``; one that came after the old deadline leaves the lease lost, as are the
    leases it did not extend."""
    if deadline is None:
        return _confirm(lease, reply, 0.0, True, -1.0)
    return _confirm(lease, reply, deadline, False, -1.0)


cdef bint _mine(bytes reply, bytes value) noexcept:
    # The lock's value is ``value``, or ``value`` marked by a waiter (_scripts.MARK).
    cdef Py_ssize_t n = PyBytes_GET_SIZE(value), extra = PyBytes_GET_SIZE(reply) - n
    if (extra != 0 and extra != PyBytes_GET_SIZE(_MARK)) or memcmp(
        PyBytes_AS_STRING(reply), PyBytes_AS_STRING(value), n
    ) != 0:
        return False
    return extra == 0 or memcmp(PyBytes_AS_STRING(reply) + n, PyBytes_AS_STRING(_MARK), extra) == 0


def mine(bytes reply, bytes value):
    """Whether a lock's value ``reply`` is ``value``'s: the token itself, or the token
    marked by a waiter that queued for the lock."""
    return _mine(reply, value)


def claims(list replies, list values):
    """``SET NX GET`` replies as acquire replies, in place: ``b"OK"`` where the key was free
    (nil) or held our own value (a grant whose reply was lost; marked, if a waiter has
    queued since), None where it held another; error replies stay as they are."""
    cdef Py_ssize_t i, n = min(PyList_GET_SIZE(replies), PyList_GET_SIZE(values))
    cdef object reply
    for i in range(n):
        reply = <object>PyList_GET_ITEM(replies, i)
        if reply is None:
            replies[i] = _OK
        elif type(reply) is bytes:
            replies[i] = _OK if _mine(<bytes>reply, <bytes>PyList_GET_ITEM(values, i)) else None
    return replies


def error_positions(list replies):
    """Positions of the error replies among ``replies``."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(replies)
    cdef list out = []
    for i in range(n):
        if type(<object>PyList_GET_ITEM(replies, i)) is ReplyError:
            out.append(i)
    return out


def lease_fields(list leases, Py_ssize_t start):
    """Positions, keys and values of the held leases among ``leases`` (None is skipped)."""
    cdef list idx = [], keys = [], values = []
    cdef Py_ssize_t i, n = PyList_GET_SIZE(leases)
    cdef object item
    cdef Lease lease
    for i in range(n):
        item = <object>PyList_GET_ITEM(leases, i)
        if item is None:
            continue
        if type(item) is not Lease:
            raise TypeError(f"leases[{start + i}] must be a Lease or None, not {type(item).__name__}")
        lease = <Lease>item
        if lease._held:
            idx.append(i)
            keys.append(lease._key)
            values.append(lease._value)
    return idx, keys, values


def settle(list leases, list idx, list replies, list out, bint drop_all, double deadline):
    """Writes each reply's verdict (``confirm``'s) into ``out`` at its position.

    A lease whose verdict is False is no longer held; with ``drop_all`` (release) none
    is; an extended one is sure of its lock until ``deadline``. Error replies go into
    ``out`` as they are; their count is returned.
    """
    cdef Py_ssize_t j, i, n = min(PyList_GET_SIZE(idx), PyList_GET_SIZE(replies))
    cdef Py_ssize_t errors = 0
    cdef object reply
    cdef double now = _monotonic()
    for j in range(n):
        i = idx[j]
        reply = <object>PyList_GET_ITEM(replies, j)
        if type(reply) is ReplyError:
            errors += 1
            out[i] = reply
            continue
        out[i] = _confirm(<Lease>leases[i], reply, deadline, drop_all, now)
    return errors


cdef class Reader:
    """A RESP2 reply scanner in C, with ``hiredis.Reader``'s ``feed``/``gets``."""

    cdef char* _buf
    cdef Py_ssize_t _len
    cdef Py_ssize_t _pos
    cdef Py_ssize_t _cap

    def __dealloc__(self):
        PyMem_Free(self._buf)

    def feed(self, data):
        # The buffer protocol by hand: a typed memoryview costs ~1,000 instructions a call.
        cdef Py_buffer view
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            self._append(<const char*>view.buf, view.len)
        finally:
            PyBuffer_Release(&view)

    cdef int _append(self, const char* data, Py_ssize_t n) except -1:
        cdef char* buf
        if self._pos:
            self._len -= self._pos
            if self._len:
                # The rest may overlap where it goes: memmove, not memcpy.
                memmove(self._buf, self._buf + self._pos, self._len)
            self._pos = 0
        if self._len + n > self._cap:
            buf = <char*>PyMem_Realloc(self._buf, self._len + n + 65536)
            if buf == NULL:
                raise MemoryError()
            self._buf = buf
            self._cap = self._len + n + 65536
        if n:
            memcpy(self._buf + self._len, data, n)
        self._len += n
        return 0

    def gets(self):
        """The next complete reply, or False when more bytes are needed."""
        reply = self._next()
        return False if reply is _INCOMPLETE else reply

    cdef object _next(self):
        cdef Py_ssize_t pos = self._pos
        reply = self._parse(&pos, 0)
        if reply is not _INCOMPLETE:
            self._pos = pos
        return reply

    cdef Py_ssize_t _line(self, Py_ssize_t pos) noexcept:
        # The index of the CR of the line starting at pos, or -1 while it is incomplete.
        cdef const char* cr
        while True:
            cr = <const char*>memchr(self._buf + pos, b"\r", self._len - pos)
            if cr == NULL or cr + 1 >= self._buf + self._len:
                return -1
            if cr[1] == b"\n":
                return cr - self._buf
            pos = cr - self._buf + 1

    cdef long long _integer(self, Py_ssize_t start, Py_ssize_t end) except? -1:
        cdef Py_ssize_t i = start
        cdef bint negative = False
        cdef unsigned long long u = 0
        cdef unsigned char c
        if i < end and self._buf[i] == b"-":
            negative = True
            i += 1
        if i == end or end - i > 19:
            self._bad_integer(start, end)
        while i < end:
            c = <unsigned char>self._buf[i]
            if c < 48 or c > 57:
                self._bad_integer(start, end)
            u = u * 10 + (c - 48)
            i += 1
        # 19 digits cannot wrap an unsigned 64-bit integer, so one bound check suffices.
        if u > 9223372036854775807ULL + negative:
            self._bad_integer(start, end)
        if negative:
            # Negated in range: -(2**63) as a long long cannot be negated (undefined in C).
            return -<long long>(u - 1) - 1 if u else 0
        return <long long>u

    cdef int _bad_integer(self, Py_ssize_t start, Py_ssize_t end) except -1:
        line = PyBytes_FromStringAndSize(self._buf + start, min(end - start, 32))
        raise ProtocolError(f"Protocol error: bad integer {line!r}")

    cdef object _parse(self, Py_ssize_t* ppos, int depth):
        cdef Py_ssize_t pos = ppos[0], end, _
        cdef char kind
        cdef long long v
        cdef list items
        if pos >= self._len:
            return _INCOMPLETE
        kind = self._buf[pos]
        end = self._line(pos + 1)
        if end < 0:
            return _INCOMPLETE
        if kind == b"+":
            ppos[0] = end + 2
            if end - pos - 1 == 2 and self._buf[pos + 1] == b"O" and self._buf[pos + 2] == b"K":
                return _OK
            return PyBytes_FromStringAndSize(self._buf + pos + 1, end - pos - 1)
        if kind == b":":
            v = self._integer(pos + 1, end)
            ppos[0] = end + 2
            return PyLong_FromLongLong(v)
        if kind == b"$":
            v = self._integer(pos + 1, end)
            if v < 0:
                ppos[0] = end + 2
                return None
            # Compared this way round so a huge length cannot overflow the sum.
            if v > self._len - end - 4:
                return _INCOMPLETE
            if self._buf[end + 2 + v] != b"\r" or self._buf[end + 3 + v] != b"\n":
                raise ProtocolError("Protocol error: bulk string not terminated by CRLF")
            ppos[0] = end + 4 + v
            return PyBytes_FromStringAndSize(self._buf + end + 2, v)
        if kind == b"-":
            ppos[0] = end + 2
            message = PyBytes_FromStringAndSize(self._buf + pos + 1, end - pos - 1)
            return ReplyError(message.decode(errors="replace"))
        if kind == b"*":
            v = self._integer(pos + 1, end)
            if v < 0:
                ppos[0] = end + 2
                return None
            if depth >= C_MAX_DEPTH:
                raise ProtocolError("Protocol error: replies nest too deep")
            pos = end + 2
            items = []
            for _ in range(v):
                item = self._parse(&pos, depth + 1)
                if item is _INCOMPLETE:
                    return _INCOMPLETE
                items.append(item)
            ppos[0] = pos
            return items
        raise ProtocolError(f'Protocol error, got "{chr(<unsigned char>kind)}" as reply type byte')


def receive(sock, list inbox, Py_ssize_t size):
    """One read of ``sock`` (up to ``size`` bytes), kept in ``inbox``. Compiled, the read
    and the keeping are one step: no signal handler runs between them (the pure twin's
    one C call is list.extend over map)."""
    inbox.append(sock.recv(size))


def take(Reader reader, list out, Py_ssize_t n):
    """Appends complete replies from ``reader`` to ``out`` until it holds ``n``."""
    cdef Py_ssize_t have = PyList_GET_SIZE(out)
    while have < n:
        reply = reader._next()
        if reply is _INCOMPLETE:
            break
        out.append(reply)
        have += 1
    return have
