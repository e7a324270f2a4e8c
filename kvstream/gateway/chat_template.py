"""A model's chat template, rendered as ``transformers``' ``apply_chat_template`` renders
it (what vLLM and SGLang tokenize for a chat request): a sandboxed jinja2 environment
(ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loop controls), the
globals and filters templates use (``raise_exception``, a ``tojson`` that escapes
neither HTML nor non-ASCII, ``strftime_now``, the ``generation`` tag), the special
tokens of ``tokenizer_config.json`` in the context, and the request's options as vLLM
reads them (``add_generation_prompt`` true by default, ``continue_final_message``,
``tools``, ``documents``, ``chat_template_kwargs``, a named ``chat_template``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kvstream.gateway.errors import TokenizeError, TokenizerConfigError

if TYPE_CHECKING:
    import jinja2

#: Keys of the render context a request's ``chat_template_kwargs`` may not replace.
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _environment() -> jinja2.Environment:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        # Earlier versions have known sandbox escapes; chat templates are untrusted code.
        raise TokenizerConfigError(f"chat templates need jinja2 >= 3.1.6 (installed: {jinja2.__version__})")

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training
        masks; rendering only needs its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja's own tojson escapes <, >, & for HTML: templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _iterates_content(template: Any) -> bool:
    """Whether a template loops over ``message.content`` / ``message['content']`` (then
    it takes OpenAI content parts as given), as vLLM's content-format detection asks."""
    import jinja2.nodes as n

    for loop in template.find_all(n.For):
        it = loop.iter
        if isinstance(it, n.Getattr) and it.attr == "content":
            return True
        if isinstance(it, n.Getitem) and isinstance(it.arg, n.Const) and it.arg.value == "content":
            return True
    return False


def _text_content(content: Any, i: int) -> Any:
    """OpenAI content parts as a template that wants a string gets them from vLLM: the
    text parts joined by newlines."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise TokenizeError(
                f"messages[{i}]: only text content parts can be tokenized here (ask the engine for others)"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(body: Mapping[str, Any], parts: bool) -> list[dict[str, Any]]:
    """The body's messages as the template sees them: keys with a null value dropped (as
    transformers does), tool call arguments given as a JSON string parsed and content
    parts joined for a template that wants a string (as vLLM does)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TokenizeError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TokenizeError(f"messages[{i}] must be an object")
        m = {k: v for k, v in m.items() if v is not None}
        if not parts and "content" in m:
            m["content"] = _text_content(m["content"], i)
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            m["tool_calls"] = [_parsed_call(c) for c in calls]
        out.append(m)
    return out


def _parsed_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            return call
        if isinstance(args, dict):
            return {**call, "function": {**fn, "arguments": args}}
    return call


class ChatRenderer:
    """Renders a chat body to the text the engine tokenizes."""

    def __init__(self, templates: Mapping[str, str], special_tokens: Mapping[str, str]) -> None:
        import jinja2

        self._special = dict(special_tokens)
        env = _environment()
        self._compiled: dict[str, jinja2.Template] = {}
        #: Templates that take content parts as given (the others get joined text).
        self._parts: set[str] = set()
        for name, text in templates.items():
            try:
                self._compiled[name] = env.from_string(text)
                if _iterates_content(env.parse(text)):
                    self._parts.add(name)
            except jinja2.TemplateSyntaxError as exc:
                raise TokenizerConfigError(f"chat template {name!r} does not compile: {exc}") from None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._compiled)

    def _template(self, body: Mapping[str, Any]) -> str:
        """The name of the template for this body."""
        named = body.get("chat_template")
        if named is not None:
            # Only a named template of the model: a request's own template would be code
            # run on the gateway.
            if not isinstance(named, str) or named not in self._compiled:
                raise TokenizeError(f"chat_template must name one of the model's templates: {sorted(self._compiled)}")
            return named
        if body.get("tools") and "tool_use" in self._compiled:
            return "tool_use"
        if "default" in self._compiled:
            return "default"
        if not self._compiled:
            raise TokenizeError("this model has no chat template: use /v1/completions")
        raise TokenizeError(f"this model has several chat templates and no default: {sorted(self._compiled)}")

    def render(self, body: Mapping[str, Any]) -> str:
        import jinja2

        name = self._template(body)
        template = self._compiled[name]
        messages = _messages(body, name in self._parts)
        kwargs = body.get("chat_template_kwargs")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise TokenizeError("chat_template_kwargs must be an object")
        if reserved := sorted(_RESERVED & kwargs.keys()):
            raise TokenizeError(f"chat_template_kwargs may not set {reserved}")
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise TokenizeError("tools must be a list of objects")
        documents = body.get("documents")
        generation = body.get("add_generation_prompt", True)  # vLLM's default for chat
        cont = body.get("continue_final_message", False)
        if cont and generation:
            raise TokenizeError("continue_final_message and add_generation_prompt cannot both be true")
        if cont:
            last = messages[-1]
            if not isinstance(last.get("content"), str):
                raise TokenizeError("continue_final_message needs a final message with text content")
            messages[-1] = {**last, "content": last["content"] + _CONTINUE_TAG}
        try:
            text = template.render(
                **{**self._special, **kwargs}, messages=messages, tools=tools, documents=documents,
                add_generation_prompt=bool(generation),
            )
        except jinja2.TemplateError as exc:
            raise TokenizeError(f"chat template error: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # A template reading a field this body does not have the way it expects.
            raise TokenizeError(f"chat template cannot render these messages: {type(exc).__name__}: {exc}") from None
        if cont:
            # Everything the template put after the final message's text goes: the
            # engine continues that text.
            at = text.rfind(_CONTINUE_TAG.strip())
            if at < 0:
                raise TokenizeError("continue_final_message: the template does not render the final message's text")
            text = text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
        return text
