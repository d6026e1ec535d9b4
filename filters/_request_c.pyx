# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of filters/request.py's parse_inference_request: the same decode (msgspec,
json.loads where msgspec refuses), then the fields the router needs checked and taken in C
instead of ~60 Python steps, and the frozen InferenceRequest filled slot by slot instead of
through its dataclass __init__ (one object.__setattr__ call a field). Anything that is not
the plainest shape (a prompt that is not a string, chat content that is not a string,
tool_calls) goes to the pure-Python helpers, which make every error. Results and errors
equal the reference's for any body (tests/test_request_parse_twins.py checks that with
hypothesis; fuzz target request_parse). Import via filters.hotpath.

Speed-up (shared 2-core dev machine, 2026-12, loaded; `python -m loadtest.hotpath_bench`,
two runs): the load generator's 122 B streamed completion 5.3-6.8 -> 1.8-2.2 us, a 193 B
chat request 7.3-10.2 -> 3.4-3.6 us a parse (msgspec's decode ~0.7 us of it); in the
sidecar, 0.885 -> 0.871 M instructions a request (`python -m loadtest.sidecar_instructions
--requests 200 --tokens 1`; issue #22).
"""

from cpython.object cimport PyObject_GenericSetAttr

from filters import request as _ref

__all__ = ["parse_inference_request"]

cdef object _InferenceRequest = _ref.InferenceRequest
cdef object _RequestError = _ref.RequestError
cdef object _loads = _ref._loads
cdef object _render_messages = _ref.render_messages
cdef object _prompt_text = _ref._prompt_text
cdef object _check_encodable = _ref._check_encodable
cdef object _new = object.__new__


cdef inline bint _is_int(object v):
    return isinstance(v, int) and not isinstance(v, bool)


cdef object _max_tokens(dict doc, tuple names):
    cdef object v
    for name in names:
        v = doc.get(name)
        if v is None:
            continue
        if not _is_int(v) or v < 0:
            raise _RequestError(f"'{name}' must be a non-negative integer", param=name)
        return int(v)
    return None


cdef str _render(object messages):
    """render_messages for messages of role and string (or null) content only; any other
    shape, every error included, is the reference's."""
    cdef list parts
    cdef object role, content
    if not isinstance(messages, list) or not messages:
        return _render_messages(messages)
    parts = []
    for msg in <list>messages:
        if not isinstance(msg, dict):
            return _render_messages(messages)
        role = (<dict>msg).get("role")
        content = (<dict>msg).get("content")
        if (
            not isinstance(role, str)
            or not role
            or not (content is None or isinstance(content, str))
            or (<dict>msg).get("tool_calls") is not None
        ):
            return _render_messages(messages)
        parts.append("<|")
        parts.append(role)
        parts.append("|>")
        if content:
            parts.append(content)
        parts.append("\n")
    return "".join(parts)


def parse_inference_request(str kind, object body):
    """See filters.request.parse_inference_request (the reference)."""
    cdef object doc, model, stream, n, opts, prompt, max_tokens
    cdef bint include_usage = False
    if not body:
        raise _RequestError("the request body is empty; expected a JSON object")
    doc = _loads(body)
    if not isinstance(doc, dict):
        raise _RequestError(
            f"the request body must be a JSON object, got {type(doc).__name__}"
        )
    model = (<dict>doc).get("model")
    if not isinstance(model, str) or not model:
        raise _RequestError(
            "'model' is required and must be a non-empty string", param="model"
        )
    stream = (<dict>doc).get("stream", False)
    if not isinstance(stream, bool):
        raise _RequestError("'stream' must be a boolean", param="stream")
    n = (<dict>doc).get("n", 1)
    if not _is_int(n) or n < 1:
        raise _RequestError("'n' must be a positive integer", param="n")
    opts = (<dict>doc).get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _RequestError("'stream_options' must be an object", param="stream_options")
        include_usage = bool((<dict>opts).get("include_usage", False))

    if kind == "chat":
        prompt = _render((<dict>doc).get("messages"))
        max_tokens = _max_tokens(<dict>doc, ("max_completion_tokens", "max_tokens"))
    elif kind == "completion":
        if "prompt" not in <dict>doc:
            raise _RequestError("'prompt' is required", param="prompt")
        prompt = (<dict>doc)["prompt"]
        if not isinstance(prompt, str):
            prompt = _prompt_text(prompt, "prompt")
        max_tokens = _max_tokens(<dict>doc, ("max_tokens",))
    else:
        if "input" not in <dict>doc:
            raise _RequestError("'input' is required", param="input")
        prompt = (<dict>doc)["input"]
        if not isinstance(prompt, str):
            prompt = _prompt_text(prompt, "input")
        max_tokens = None
    if not (<str>prompt).isascii():
        _check_encodable(prompt, kind)
    # The frozen dataclass's slots set directly (its __setattr__ refuses, by design).
    r = _new(_InferenceRequest)
    PyObject_GenericSetAttr(r, "kind", kind)
    PyObject_GenericSetAttr(r, "model", model)
    PyObject_GenericSetAttr(r, "prompt_text", prompt)
    PyObject_GenericSetAttr(r, "max_tokens", max_tokens)
    PyObject_GenericSetAttr(r, "stream", stream)
    PyObject_GenericSetAttr(r, "include_usage", include_usage)
    PyObject_GenericSetAttr(r, "n", n)
    PyObject_GenericSetAttr(r, "doc", doc)
    return r
