# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled twin of filters/sse.py: frames the event stream in C, and reads the common
vLLM chunk shapes with a strict C JSON skim; anything the skim is not sure of goes to the
reference's own json.loads + interpret_payload, so both twins reach the same state after
every feed() (tests/test_sse.py checks that with hypothesis). Import via filters.hotpath.

The skim accepts only a subset of JSON on which it agrees with json.loads by construction:
a top-level object; escapes checked by json's rules (a string value it needs that holds
escapes is decoded by json's own scanstring; an escaped key falls back, it might spell a
key we read); no control bytes in strings, no non-ASCII outside strings; numbers of at
most 32 characters (int's max-str-digits limit never applies), no NaN/Infinity; nesting
under 64; no repeated key among the keys it reads (json.loads keeps the last);
"usage"/"error" null or absent. Everything else falls back to json.loads.

Most events skip even the skim. An engine writes a stream's chunks alike (vLLM and SGLang:
the same id, created, model, keys and order in each), so they differ only in the token's
string. The scanner keeps the last event the skim read exactly whose choices hold one str
"text" or "delta"."content" as a template: the bytes before that string and after it. An
event that is those bytes around another string is read with two memcmp and one string
check, exactly as the skim would read it (SSEScanner._from_template says why); any other
event takes the skim.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.string cimport memchr, memcmp, memcpy

from json.decoder import scanstring as _scanstring

from filters.sse import DEFAULT_MAX_EVENT_BYTES, SSEError, decode_payload, interpret_payload

__all__ = ["DEFAULT_MAX_EVENT_BYTES", "SSEError", "SSEScanner"]

cdef enum:
    MAX_DEPTH = 64  # deeper JSON falls back (json.loads has its own recursion limit)
    MAX_TEXT_SPANS = 16  # index-0 text pieces per event; more falls back
    MAX_NUMBER_CHARS = 32

cdef const unsigned char* _BOM = b"\xef\xbb\xbf"

cdef enum:
    # bits of keys already seen, for the repeated-key check
    K_ID = 1
    K_CHOICES = 2
    K_USAGE = 4
    K_ERROR = 8
    K_INDEX = 16
    K_TEXT = 32
    K_DELTA = 64
    K_FINISH = 128
    K_CONTENT = 256
    K_RC = 512
    K_REASONING = 1024
    K_TOOLS = 2048


cdef struct Span:
    Py_ssize_t a  # first byte of a JSON string's content; -1: absent
    Py_ssize_t b  # one past its last byte
    bint esc  # it holds backslash escapes


cdef struct Skim:
    bint collect
    bint token
    Span rid
    Span finish
    int ntext
    Span text[MAX_TEXT_SPANS]
    # For the template (SSEScanner._from_template): the str values of choices' "text" and
    # "delta"."content" (empty ones too), the last of them, whether its choice is choice 0,
    # and whether anything else (reasoning, tool calls) made the event token-bearing.
    int nslot
    Span slot
    bint slot_index0
    bint other


cdef inline Py_ssize_t _ws(const unsigned char* p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    cdef unsigned char c
    while i < n:
        c = p[i]
        if c == 32 or c == 9 or c == 10 or c == 13:
            i += 1
        else:
            break
    return i


cdef inline bint _hex(unsigned char c) noexcept nogil:
    return (48 <= c <= 57) or (97 <= c <= 102) or (65 <= c <= 70)


cdef inline Py_ssize_t _string(const unsigned char* p, Py_ssize_t i, Py_ssize_t n,
                               bint* esc) noexcept nogil:
    """p[i] is '"'; the index past the closing quote, or -1 (bad escape, control byte,
    EOF). Escapes are checked as json.loads checks them; `esc` says if there were any."""
    cdef unsigned char c
    i += 1
    while i < n:
        c = p[i]
        if c == 34:
            return i + 1
        if c == 92:
            esc[0] = True
            i += 1
            if i >= n:
                return -1
            c = p[i]
            if c == 117:  # \uXXXX; lone surrogates are fine for json.loads too
                if n - i < 5 or not (_hex(p[i + 1]) and _hex(p[i + 2]) and _hex(p[i + 3])
                                     and _hex(p[i + 4])):
                    return -1
                i += 4
            elif not (c == 34 or c == 92 or c == 47 or c == 98 or c == 102 or c == 110
                      or c == 114 or c == 116):
                return -1
        elif c < 32:
            return -1
        i += 1
    return -1


cdef inline Py_ssize_t _str_span(const unsigned char* p, Py_ssize_t i, Py_ssize_t n,
                                 Span* span) noexcept nogil:
    """A string value we read: sets `span` to its content; the index past it, or -1."""
    cdef bint esc = False
    cdef Py_ssize_t j = _string(p, i, n, &esc)
    if j >= 0:
        span.a = i + 1
        span.b = j - 1
        span.esc = esc
    return j


cdef inline Py_ssize_t _key_string(const unsigned char* p, Py_ssize_t i,
                                   Py_ssize_t n) noexcept nogil:
    """A key: like _string, but an escaped key might spell a key we read, so give up."""
    cdef bint esc = False
    i = _string(p, i, n, &esc)
    return -1 if esc else i


cdef inline bint _digit(unsigned char c) noexcept nogil:
    return 48 <= c <= 57


cdef Py_ssize_t _number(const unsigned char* p, Py_ssize_t i, Py_ssize_t n,
                        int* plain_int, int* zero) noexcept nogil:
    """A JSON number at p[i]: the index past it, or -1. Sets whether it is an integer
    literal (no fraction/exponent) and whether that integer is 0 (also "-0")."""
    cdef Py_ssize_t start = i
    plain_int[0] = 1
    zero[0] = 0
    if i < n and p[i] == 45:  # '-'
        i += 1
    if i >= n:
        return -1
    if p[i] == 48:  # '0'
        zero[0] = 1
        i += 1
    elif 49 <= p[i] <= 57:
        i += 1
        while i < n and _digit(p[i]):
            i += 1
    else:
        return -1
    if i < n and p[i] == 46:  # '.'
        plain_int[0] = 0
        i += 1
        if i >= n or not _digit(p[i]):
            return -1
        while i < n and _digit(p[i]):
            i += 1
    if i < n and (p[i] == 101 or p[i] == 69):  # 'e' 'E'
        plain_int[0] = 0
        i += 1
        if i < n and (p[i] == 43 or p[i] == 45):
            i += 1
        if i >= n or not _digit(p[i]):
            return -1
        while i < n and _digit(p[i]):
            i += 1
    # Long integer literals may hit int's max-str-digits limit in json.loads.
    if i - start > MAX_NUMBER_CHARS:
        return -1
    return i


cdef inline Py_ssize_t _literal(const unsigned char* p, Py_ssize_t i, Py_ssize_t n,
                                const char* word, Py_ssize_t k) noexcept nogil:
    if n - i >= k and memcmp(p + i, word, k) == 0:
        return i + k
    return -1


cdef inline bint _is_null(const unsigned char* p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    return n - i >= 4 and memcmp(p + i, b"null", 4) == 0


cdef Py_ssize_t _value(const unsigned char* p, Py_ssize_t i, Py_ssize_t n,
                       int depth) noexcept nogil:
    """Skip any JSON value at p[i] (after whitespace); the index past it, or -1."""
    cdef unsigned char c
    cdef int a, b
    cdef bint esc = False
    if i >= n or depth > MAX_DEPTH:
        return -1
    c = p[i]
    if c == 34:
        return _string(p, i, n, &esc)
    if c == 123:  # '{'
        i = _ws(p, i + 1, n)
        if i < n and p[i] == 125:
            return i + 1
        while True:
            if i >= n or p[i] != 34:
                return -1
            i = _string(p, i, n, &esc)
            if i < 0:
                return -1
            i = _ws(p, i, n)
            if i >= n or p[i] != 58:  # ':'
                return -1
            i = _value(p, _ws(p, i + 1, n), n, depth + 1)
            if i < 0:
                return -1
            i = _ws(p, i, n)
            if i >= n:
                return -1
            if p[i] == 125:
                return i + 1
            if p[i] != 44:
                return -1
            i = _ws(p, i + 1, n)
    if c == 91:  # '['
        i = _ws(p, i + 1, n)
        if i < n and p[i] == 93:
            return i + 1
        while True:
            i = _value(p, i, n, depth + 1)
            if i < 0:
                return -1
            i = _ws(p, i, n)
            if i >= n:
                return -1
            if p[i] == 93:
                return i + 1
            if p[i] != 44:
                return -1
            i = _ws(p, i + 1, n)
    if c == 45 or _digit(c):
        return _number(p, i, n, &a, &b)
    if c == 116:
        return _literal(p, i, n, b"true", 4)
    if c == 102:
        return _literal(p, i, n, b"false", 5)
    if c == 110:
        return _literal(p, i, n, b"null", 4)
    return -1


cdef inline bint _key(const unsigned char* p, Py_ssize_t a, Py_ssize_t b,
                      const char* name, Py_ssize_t k) noexcept nogil:
    """The key string p[a:b] (quotes included) equals `name`."""
    return b - a - 2 == k and memcmp(p + a + 1, name, k) == 0


cdef inline bint _seen(int* mask, int bit) noexcept nogil:
    if mask[0] & bit:
        return True
    mask[0] |= bit
    return False


cdef Py_ssize_t _delta(const unsigned char* p, Py_ssize_t i, Py_ssize_t n, Span* content,
                       bint* other_token) noexcept nogil:
    """A choice's "delta" object at p[i] == '{'."""
    cdef int mask = 0
    cdef bint esc
    cdef Py_ssize_t ka, kb, j
    i = _ws(p, i + 1, n)
    if i < n and p[i] == 125:
        return i + 1
    while True:
        if i >= n or p[i] != 34:
            return -1
        ka = i
        kb = _key_string(p, i, n)
        if kb < 0:
            return -1
        i = _ws(p, kb, n)
        if i >= n or p[i] != 58:
            return -1
        i = _ws(p, i + 1, n)
        if i >= n:
            return -1
        if _key(p, ka, kb, b"content", 7):
            if _seen(&mask, K_CONTENT):
                return -1
            if p[i] == 34:
                i = _str_span(p, i, n, content)
            else:
                i = _value(p, i, n, 3)
        elif _key(p, ka, kb, b"reasoning_content", 17) or _key(p, ka, kb, b"reasoning", 9):
            if _seen(&mask, K_RC if kb - ka == 19 else K_REASONING):
                return -1
            if p[i] == 34:
                esc = False
                j = _string(p, i, n, &esc)
                if j < 0:
                    return -1
                if j - i > 2:
                    other_token[0] = True
                i = j
            else:
                i = _value(p, i, n, 3)
        elif _key(p, ka, kb, b"tool_calls", 10):
            if _seen(&mask, K_TOOLS):
                return -1
            if p[i] == 91:
                j = _ws(p, i + 1, n)
                if j < n and p[j] != 93:
                    other_token[0] = True
            i = _value(p, i, n, 3)
        else:
            i = _value(p, i, n, 3)
        if i < 0:
            return -1
        i = _ws(p, i, n)
        if i >= n:
            return -1
        if p[i] == 125:
            return i + 1
        if p[i] != 44:
            return -1
        i = _ws(p, i + 1, n)


cdef Py_ssize_t _choice(const unsigned char* p, Py_ssize_t i, Py_ssize_t n,
                        Skim* out) noexcept nogil:
    """One element of "choices" at p[i] == '{'; folds it into `out`."""
    cdef int mask = 0
    cdef int plain_int = 0, zero = 0
    cdef bint index0 = True  # an absent index is choice 0
    cdef bint other_token = False
    cdef Span text, content, finish
    cdef Py_ssize_t ka, kb, j
    text.a = -1
    content.a = -1
    finish.a = -1
    i = _ws(p, i + 1, n)
    if i < n and p[i] == 125:
        return i + 1
    while True:
        if i >= n or p[i] != 34:
            return -1
        ka = i
        kb = _key_string(p, i, n)
        if kb < 0:
            return -1
        i = _ws(p, kb, n)
        if i >= n or p[i] != 58:
            return -1
        i = _ws(p, i + 1, n)
        if i >= n:
            return -1
        if _key(p, ka, kb, b"index", 5):
            if _seen(&mask, K_INDEX):
                return -1
            if p[i] == 45 or _digit(p[i]):
                i = _number(p, i, n, &plain_int, &zero)
                index0 = plain_int and zero
            else:
                # null, bool, str...: not the int 0, so not choice 0
                index0 = False
                i = _value(p, i, n, 2)
        elif _key(p, ka, kb, b"text", 4):
            if _seen(&mask, K_TEXT):
                return -1
            if p[i] == 34:
                i = _str_span(p, i, n, &text)
            else:
                i = _value(p, i, n, 2)
        elif _key(p, ka, kb, b"delta", 5):
            if _seen(&mask, K_DELTA):
                return -1
            if p[i] == 123:
                i = _delta(p, i, n, &content, &other_token)
            else:
                i = _value(p, i, n, 2)
        elif _key(p, ka, kb, b"finish_reason", 13):
            if _seen(&mask, K_FINISH):
                return -1
            if p[i] == 34:
                i = _str_span(p, i, n, &finish)
            else:
                i = _value(p, i, n, 2)
        else:
            i = _value(p, i, n, 2)
        if i < 0:
            return -1
        i = _ws(p, i, n)
        if i >= n:
            return -1
        if p[i] == 125:
            i += 1
            break
        if p[i] != 44:
            return -1
        i = _ws(p, i + 1, n)
    if text.a >= 0:
        out.nslot += 1
        out.slot = text
        out.slot_index0 = index0
    if content.a >= 0:
        out.nslot += 1
        out.slot = content
        out.slot_index0 = index0
    # Same order as interpret_payload: text, then delta.content, then finish_reason.
    if text.a >= 0 and text.b > text.a:
        out.token = True
        if out.collect and index0:
            if out.ntext == MAX_TEXT_SPANS:
                return -1
            out.text[out.ntext] = text
            out.ntext += 1
    if content.a >= 0 and content.b > content.a:
        out.token = True
        if out.collect and index0:
            if out.ntext == MAX_TEXT_SPANS:
                return -1
            out.text[out.ntext] = content
            out.ntext += 1
    if other_token:
        out.token = True
        out.other = True
    if finish.a >= 0:
        out.finish = finish
    return i


cdef bint _skim(const unsigned char* p, Py_ssize_t n, Skim* out) noexcept nogil:
    """Read one event's data; True when `out` is exact, False to fall back to json."""
    cdef int mask = 0
    cdef Py_ssize_t i, ka, kb, j
    out.token = False
    out.rid.a = -1
    out.finish.a = -1
    out.ntext = 0
    out.nslot = 0
    out.other = False
    i = _ws(p, 0, n)
    if i >= n or p[i] != 123:
        return False
    i = _ws(p, i + 1, n)
    if i < n and p[i] == 125:
        i += 1
    else:
        while True:
            if i >= n or p[i] != 34:
                return False
            ka = i
            kb = _key_string(p, i, n)
            if kb < 0:
                return False
            i = _ws(p, kb, n)
            if i >= n or p[i] != 58:
                return False
            i = _ws(p, i + 1, n)
            if i >= n:
                return False
            if _key(p, ka, kb, b"id", 2):
                if _seen(&mask, K_ID):
                    return False
                if p[i] == 34:
                    i = _str_span(p, i, n, &out.rid)
                else:
                    i = _value(p, i, n, 1)
            elif _key(p, ka, kb, b"choices", 7):
                if _seen(&mask, K_CHOICES):
                    return False
                if p[i] == 91:
                    i = _ws(p, i + 1, n)
                    if i < n and p[i] == 93:
                        i += 1
                    else:
                        while True:
                            if i < n and p[i] == 123:
                                i = _choice(p, i, n, out)
                            else:
                                i = _value(p, i, n, 2)
                            if i < 0:
                                return False
                            i = _ws(p, i, n)
                            if i >= n:
                                return False
                            if p[i] == 93:
                                i += 1
                                break
                            if p[i] != 44:
                                return False
                            i = _ws(p, i + 1, n)
                else:
                    i = _value(p, i, n, 1)
            elif _key(p, ka, kb, b"usage", 5) or _key(p, ka, kb, b"error", 5):
                if _seen(&mask, K_USAGE if p[ka + 1] == 117 else K_ERROR):
                    return False
                # A usage or error object is rare (once per stream): json.loads builds it.
                if not _is_null(p, i, n):
                    return False
                i += 4
            else:
                i = _value(p, i, n, 1)
            if i < 0:
                return False
            i = _ws(p, i, n)
            if i >= n:
                return False
            if p[i] == 125:
                i += 1
                break
            if p[i] != 44:
                return False
            i = _ws(p, i + 1, n)
    return _ws(p, i, n) == n


cdef inline str _decode(const unsigned char* p, Span s):
    if not s.esc:
        return PyUnicode_DecodeUTF8(<const char*>p + s.a, s.b - s.a, "replace")
    # json's own string scanner on the quoted string: exactly what json.loads would give.
    return _scanstring(PyUnicode_DecodeUTF8(<const char*>p + s.a - 1, s.b - s.a + 2, "replace"),
                       1, True)[0]


cdef class SSEScanner:
    """Compiled twin of filters.sse.SSEScanner; same constructor, methods and state.

    Speeds up scanning every streamed response. Measured by `python -m
    loadtest.hotpath_bench --repeats 11` on a 1 MB vLLM-style chat stream (~4,800 events,
    one token each, ~3% with JSON escapes), two runs on a shared 2-core x86_64 dev VM,
    Python 3.11, 2026-12: pure Python 31-34 ms; this 0.32-0.33 ms in 1,400-byte reads and
    0.31-0.32 ms in one read per event (as engines write them), ~100x. Without the template
    (skim only) it was 1.07-1.08 ms and 1.27 ms; `python -m loadtest.sidecar_instructions
    --tokens 200 --requests 200` went from 1.82-1.85 M to 1.35-1.36 M instructions a request
    (~2,500 fewer an event). An event that takes the skim costs ~2,700 instructions, one the
    skim cannot read exactly what the pure twin pays (json.loads).
    """

    cdef readonly Py_ssize_t events
    cdef readonly Py_ssize_t tokens
    cdef readonly bint done
    cdef readonly object usage
    cdef readonly object finish_reason
    cdef readonly object response_id
    cdef readonly object error
    cdef bint _collect
    cdef Py_ssize_t _max
    cdef bint _closed
    cdef bint _skip_lf
    cdef object _failed
    cdef bint _head_open  # stream start: we do not know yet whether a BOM leads
    cdef unsigned char _head[3]
    cdef Py_ssize_t _head_len
    cdef unsigned char* _line  # the current partial line, without terminator
    cdef Py_ssize_t _line_len
    cdef Py_ssize_t _line_cap
    cdef unsigned char* _data  # the current event's data values, joined by LF
    cdef Py_ssize_t _data_len
    cdef Py_ssize_t _data_cap
    cdef bint _has_data
    cdef Py_ssize_t _event_bytes
    cdef list _text_parts
    cdef object _text
    cdef Skim _sk
    # The template: the last event the skim read exactly whose choices hold one str "text"
    # or "content" (the slot), kept as the bytes before the slot's string (_tpl_plen) and
    # after it (_tpl_tlen), with what the skim found outside the slot.
    cdef unsigned char* _tpl
    cdef Py_ssize_t _tpl_cap
    cdef Py_ssize_t _tpl_plen
    cdef Py_ssize_t _tpl_tlen
    cdef bint _tpl_ok
    cdef bint _tpl_other
    cdef bint _tpl_index0
    cdef Span _tpl_finish  # in the tail: offsets from the tail's start
    cdef bint _tpl_finish_tail

    def __cinit__(self):
        self._line = NULL
        self._data = NULL
        self._tpl = NULL

    def __dealloc__(self):
        PyMem_Free(self._line)
        PyMem_Free(self._data)
        PyMem_Free(self._tpl)

    def __init__(self, collect_text=False, max_event_bytes=DEFAULT_MAX_EVENT_BYTES):
        if max_event_bytes < 1:
            raise ValueError(f"max_event_bytes must be >= 1, got {max_event_bytes}")
        self._collect = bool(collect_text)
        self._max = int(max_event_bytes)
        self._head_open = True
        self._head_len = 0
        self._line_len = 0
        self._data_len = 0
        self._has_data = False
        self._event_bytes = 0
        self._skip_lf = False
        self._closed = False
        self._failed = None
        self._tpl_ok = False
        self._text_parts = []
        self._text = ""
        self.events = 0
        self.tokens = 0
        self.done = False
        self.usage = None
        self.finish_reason = None
        self.response_id = None
        self.error = None

    @property
    def text(self):
        """Concatenated output of choice 0 (text and delta.content) when collect_text."""
        if self._text is None:
            self._text = "".join(self._text_parts)
        return self._text

    def close(self):
        """End of stream. A pending unterminated event is discarded (WHATWG SSE)."""
        self._closed = True
        self._line_len = 0
        self._data_len = 0
        self._has_data = False
        self._head_open = False

    def feed(self, chunk):
        """Scan the next bytes; return how many token-bearing events they completed.

        Same contract as filters.sse.SSEScanner.feed (see the class docstring for speed).
        """
        if not isinstance(chunk, (bytes, bytearray, memoryview)):
            raise TypeError(f"chunk must be bytes-like, not {type(chunk).__name__}")
        if self._failed is not None:
            raise SSEError(self._failed)
        if self._closed:
            raise ValueError("feed() after close()")
        if type(chunk) is not bytes:
            chunk = bytes(chunk)
        # The bytes' own storage, not a typed memoryview: acquiring one costs ~800
        # instructions, a fifth of a whole event's scan before the template.
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(chunk)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(chunk)
        cdef Py_ssize_t tokens_before = self.tokens
        cdef Py_ssize_t i = 0, k
        if self._head_open:
            k = 0
            while k < n and self._head_len + k < 3 and p[k] == _BOM[self._head_len + k]:
                k += 1
            if self._head_len + k < 3 and k == n:
                memcpy(self._head + self._head_len, p, k)
                self._head_len += k
                return 0
            self._head_open = False
            if self._head_len + k == 3:
                i = k  # a BOM: drop it
            else:
                # Held bytes were not a BOM after all; they start the first line (they
                # hold no line break, so they only extend the partial line).
                self._append_line(self._head, self._head_len)
        self._scan(p, i, n)
        return self.tokens - tokens_before

    cdef int _scan(self, const unsigned char* p, Py_ssize_t i, Py_ssize_t n) except -1:
        cdef Py_ssize_t cr = -1, lf = -1, e
        cdef const void* hit
        if self._skip_lf and i < n:
            self._skip_lf = False
            if p[i] == 10:
                i += 1
        while i < n:
            # Next CR and next LF, each found with memchr and kept until passed, so the
            # whole chunk is searched about twice at most.
            if cr < i:
                hit = memchr(p + i, 13, n - i)
                cr = n if hit == NULL else <const unsigned char*>hit - p
            if lf < i:
                hit = memchr(p + i, 10, n - i)
                lf = n if hit == NULL else <const unsigned char*>hit - p
            e = cr if cr < lf else lf
            if e >= n:
                break
            self._line_done(p + i, e - i)
            if e == cr:
                if e + 1 < n:
                    if p[e + 1] == 10:
                        e += 1
                else:
                    self._skip_lf = True
            i = e + 1
        if i < n:
            if self._event_bytes + self._line_len + (n - i) > self._max:
                self._fail()
            self._append_line(p + i, n - i)
        return 0

    cdef int _fail(self) except -1:
        self._failed = (
            f"SSE event larger than max_event_bytes={self._max} bytes "
            "(an event is every line up to the blank line that ends it)"
        )
        self._line_len = 0
        self._data_len = 0
        self._has_data = False
        raise SSEError(self._failed)

    cdef int _grow(self, unsigned char** buf, Py_ssize_t* cap, Py_ssize_t need) except -1:
        cdef Py_ssize_t new_cap = cap[0] * 2 if cap[0] else 256
        cdef unsigned char* nb
        while new_cap < need:
            new_cap *= 2
        nb = <unsigned char*>PyMem_Realloc(buf[0], new_cap)
        if nb == NULL:
            raise MemoryError()
        buf[0] = nb
        cap[0] = new_cap
        return 0

    cdef int _append_line(self, const unsigned char* s, Py_ssize_t k) except -1:
        if self._line_len + k > self._line_cap:
            self._grow(&self._line, &self._line_cap, self._line_len + k)
        if k:
            memcpy(self._line + self._line_len, s, k)
        self._line_len += k
        return 0

    cdef int _line_done(self, const unsigned char* s, Py_ssize_t k) except -1:
        if self._line_len:
            if self._event_bytes + self._line_len + k > self._max:
                self._fail()
            self._append_line(s, k)
            k = self._line_len
            self._line_len = 0
            return self._field(self._line, k)
        if k == 0:
            return self._dispatch()
        if self._event_bytes + k > self._max:
            self._fail()
        return self._field(s, k)

    cdef int _field(self, const unsigned char* s, Py_ssize_t k) except -1:
        self._event_bytes += k
        # The field name is everything before the first colon; only "data" matters here.
        if k >= 5 and memcmp(s, b"data:", 5) == 0:
            s += 5
            k -= 5
            if k and s[0] == 32:
                s += 1
                k -= 1
            self._append_data(s, k)
        elif k == 4 and memcmp(s, b"data", 4) == 0:
            self._append_data(s, 0)
        return 0

    cdef int _append_data(self, const unsigned char* s, Py_ssize_t k) except -1:
        cdef Py_ssize_t need = self._data_len + k + 1
        if need > self._data_cap:
            self._grow(&self._data, &self._data_cap, need)
        if self._has_data:
            self._data[self._data_len] = 10
            self._data_len += 1
        if k:
            memcpy(self._data + self._data_len, s, k)
        self._data_len += k
        self._has_data = True
        return 0

    cdef int _dispatch(self) except -1:
        cdef Py_ssize_t n = self._data_len
        cdef const unsigned char* d = self._data
        cdef int t
        self._event_bytes = 0
        if not self._has_data:
            return 0
        self._has_data = False
        self._data_len = 0
        if n == 6 and memcmp(d, b"[DONE]", 6) == 0:
            self.done = True
            return 0
        self.events += 1
        self._sk.collect = self._collect
        if not (self._tpl_ok and self._from_template(d, n)):
            if not _skim(d, n, &self._sk):
                obj = decode_payload(PyBytes_FromStringAndSize(<const char*>d, n))
                self._apply(interpret_payload(obj, self._collect))
                return 0
            if self._sk.nslot == 1:
                self._keep_template(d, n)
        if self._sk.token:
            self.tokens += 1
        if self.response_id is None and self._sk.rid.a >= 0:
            self.response_id = _decode(d, self._sk.rid)
        if self._sk.finish.a >= 0:
            self.finish_reason = _decode(d, self._sk.finish)
        if self._sk.ntext:
            for t in range(self._sk.ntext):
                self._text_parts.append(_decode(d, self._sk.text[t]))
            self._text = None
        return 0

    cdef bint _from_template(self, const unsigned char* d, Py_ssize_t n) noexcept:
        """Read an event that is the template with another string in the slot, filling
        `_sk` as _skim would; False if it is not. Exact because the skim reads left to
        right: on the same bytes before the slot it reaches the slot in the same state,
        reads the slot's string with the same _string, and after it reads the same bytes
        from the same state; only the slot's span and what hangs on it (its emptiness,
        the spans after it) differ. Speeds up every vLLM/SGLang chunk after the first: a
        stream's chunks differ only in the token's string (and the last one's finish)."""
        cdef Py_ssize_t plen = self._tpl_plen, tlen = self._tpl_tlen, j
        cdef bint esc = False
        cdef Skim* sk = &self._sk
        if n - plen - tlen < 2 or d[plen] != 34 or memcmp(d, self._tpl, plen) != 0:
            return False
        # Bounded before the tail: a string that runs into it is not the template's shape.
        j = _string(d, plen, n - tlen, &esc)
        if j != n - tlen or memcmp(d + j, self._tpl + plen, tlen) != 0:
            return False
        sk.token = self._tpl_other or j - plen > 2
        sk.ntext = 0
        if sk.collect and self._tpl_index0 and j - plen > 2:
            sk.text[0].a = plen + 1
            sk.text[0].b = j - 1
            sk.text[0].esc = esc
            sk.ntext = 1
        # A str id in the template set response_id when the template was kept, and only
        # the first id counts: there is none to read here.
        sk.rid.a = -1
        sk.finish = self._tpl_finish
        if self._tpl_finish_tail:
            sk.finish.a += j
            sk.finish.b += j
        return True

    cdef int _keep_template(self, const unsigned char* d, Py_ssize_t n) except -1:
        """After _skim read `d` exactly with one slot: make it the template."""
        cdef Skim* sk = &self._sk
        cdef Py_ssize_t plen = sk.slot.a - 1, tail = sk.slot.b + 1
        cdef Py_ssize_t tlen = n - tail
        if plen + tlen > self._tpl_cap:
            self._grow(&self._tpl, &self._tpl_cap, plen + tlen)
        memcpy(self._tpl, d, plen)
        memcpy(self._tpl + plen, d + tail, tlen)
        self._tpl_plen = plen
        self._tpl_tlen = tlen
        self._tpl_other = sk.other
        self._tpl_index0 = sk.slot_index0
        # The finish span is wholly before or wholly after the slot (strings do not overlap).
        self._tpl_finish = sk.finish
        self._tpl_finish_tail = sk.finish.a >= tail
        if self._tpl_finish_tail:
            self._tpl_finish.a -= tail
            self._tpl_finish.b -= tail
        self._tpl_ok = True
        return 0

    cdef _apply(self, p):
        if p.token:
            self.tokens += 1
        if self.response_id is None and p.response_id is not None:
            self.response_id = p.response_id
        if p.usage is not None:
            self.usage = p.usage
        if p.error is not None:
            self.error = p.error
        if p.finish_reason is not None:
            self.finish_reason = p.finish_reason
        if p.text:
            self._text_parts.extend(p.text)
            self._text = None
