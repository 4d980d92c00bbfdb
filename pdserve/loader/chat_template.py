"""Chat-template rendering in a sandboxed jinja2 environment.

Chat templates ship with model weights (``tokenizer_config.json``, ``chat_template.jinja`` or the
``tokenizer.chat_template`` GGUF key), so they are untrusted code.  They are rendered in
``jinja2.sandbox.ImmutableSandboxedEnvironment`` configured the way Hugging Face transformers
configures it (``trim_blocks=True, lstrip_blocks=True`` plus the ``loopcontrols`` extension), so
templates written for ``transformers.apply_chat_template`` render identically here.

Helpers exposed to templates (same names and behaviour as transformers):

* ``raise_exception(msg)`` -- aborts rendering; surfaces here as :class:`ValueError`.
* ``tojson`` filter -- ``json.dumps`` that keeps non-ASCII characters and does not HTML-escape.
* ``strftime_now(fmt)`` -- current local time formatted with ``datetime.strftime``.
* ``namespace(...)`` -- jinja's namespace, refusing underscore-prefixed attribute names.

Every failure (syntax error, sandbox violation, ``raise_exception``, undefined variable, type error
inside the template, malformed messages) is reported as :class:`ValueError`.
"""

from __future__ import annotations

import functools
import json
import numbers
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

__all__ = ["render_chat_template", "normalize_messages", "compile_chat_template"]


class _TemplateRaised(Exception):
    """Raised by the template's ``raise_exception`` helper."""


def _raise_exception(message: Any = "") -> None:
    raise _TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's built-in tojson HTML-escapes '<', '>', '&' and "'"; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=tuple(separators) if separators is not None else None,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses dunder / private attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for key in attrs:
            _SafeNamespace._check(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not use underscore-prefixed namespace attributes ({name!r})")


class _StrictSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, but touching an unsafe attribute fails at once.

    jinja's sandbox answers ``''.__class__`` with an Undefined that only raises when it is used
    further (printing it renders nothing); here any such access raises ``SecurityError``.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    return env


@functools.lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile (and cache) a chat template. Syntax errors become :class:`ValueError`."""
    if not isinstance(template, str):
        raise ValueError(f"chat template must be a string, got {type(template).__name__}")
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"invalid chat template (line {exc.lineno}): {exc.message}") from exc
    except jinja2.TemplateError as exc:
        raise ValueError(f"invalid chat template: {exc}") from exc


def _plain(value: Any, path: str) -> Any:
    """Deep-copy ``value`` into plain JSON-like Python types.

    Templates only ever see str/int/float/bool/None/list/dict, so no caller object with extra
    methods (numpy scalars, pydantic models, str subclasses...) is reachable from the sandbox.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, numbers.Integral):  # bool subclasses, numpy integers
        return bool(value) if isinstance(value, bool) else int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{path}: keys must be strings, got {type(key).__name__}")
            out[str.__str__(key)] = _plain(item, f"{path}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{path}[{i}]") for i, item in enumerate(value)]
    raise ValueError(f"{path}: unsupported value of type {type(value).__name__}")


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise ValueError(f"{where}.content[{j}] must be an object, got {type(part).__name__}")
            kind = part.get("type", "text")
            if kind != "text":
                raise ValueError(f"{where}.content[{j}]: only text content parts are supported, "
                                 f"got type {kind!r}")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}.content[{j}].text must be a string")
            texts.append(text)
        return "\n".join(texts)
    raise ValueError(f"{where}.content must be a string or a list of text parts, "
                     f"got {type(content).__name__}")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate chat messages and return plain-dict copies.

    Each message must be a mapping with a string ``role`` and a ``content`` that is a string or a
    list of ``{"type": "text", "text": ...}`` parts (joined with ``"\\n"``).  An assistant message
    carrying ``tool_calls`` may have ``content`` missing/None; it is rendered as ``""``.  Other keys
    (``name``, ``tool_calls``, ``tool_call_id``, ...) are passed through to the template; keys whose
    value is None are dropped, as transformers does.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of message objects")
    if len(messages) == 0:
        raise ValueError("messages must not be empty")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where} must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}.role must be a non-empty string")
        content = msg.get("content")
        if content is None and msg.get("tool_calls"):
            text = ""
        elif "content" not in msg:
            raise ValueError(f"{where} has no content")
        else:
            text = _content_text(content, where)
        rest = {k: v for k, v in msg.items() if k not in ("role", "content") and v is not None}
        plain = _plain(rest, where)
        plain["role"] = str.__str__(role)
        plain["content"] = str.__str__(text)
        out.append(plain)
    return out


def render_chat_template(template: str, messages: Any, add_generation_prompt: bool = True,
                         bos_token: str | None = None, eos_token: str | None = None,
                         **extra: Any) -> str:
    """Render ``template`` for ``messages``.

    ``extra`` keyword arguments (``tools``, ``documents``, ``enable_thinking``, ...) become template
    variables; ``None`` values are passed as-is (templates test them with ``is defined``/``is none``).
    """
    compiled = compile_chat_template(template)
    context: dict[str, Any] = {}
    for key, value in extra.items():
        context[key] = _plain(value, key)
    context.update(
        messages=normalize_messages(messages),
        add_generation_prompt=bool(add_generation_prompt),
        bos_token=bos_token if bos_token is not None else "",
        eos_token=eos_token if eos_token is not None else "",
    )
    try:
        return compiled.render(**context)
    except _TemplateRaised as exc:
        raise ValueError(f"chat template error: {exc}") from exc
    except jinja2.exceptions.SecurityError as exc:
        raise ValueError(f"chat template violated the sandbox: {exc}") from exc
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template failed to render: {exc}") from exc
    except (TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as exc:
        raise ValueError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc
