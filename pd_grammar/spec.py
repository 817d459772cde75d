"""From an OpenAI chat/completions body to the grammar its output must follow.

* ``response_format`` ``{"type": "json_object"}`` -> any JSON object;
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` -> that schema.
  Compiled as vLLM compiles them with xgrammar (``json_object`` is the schema
  ``{"type": "object"}``; whitespace free), so that prefill's first token and the
  decode server's mask follow the same grammar.
* ``tools`` in a chat (``tool_choice`` ``auto``, none given, ``required`` or a named function)
  -> GLM tool calls as vLLM 0.32 constrains them (:mod:`pd_grammar.tool_calls`), with an
  ``auto`` chat's structured output as the alternative to its calls. vLLM's prefill builds
  the same grammar itself (it runs GLM's tool-call parser), so the router sends the fields
  as the client sent them.
* ``structured_outputs`` (vLLM's own field, chat and completions): exactly one of ``json``
  (a schema, or its JSON text), ``json_object``, ``regex``, ``choice`` (a list of strings:
  an EBNF alternation of them, as vLLM's xgrammar backend turns it into a grammar),
  ``grammar`` (EBNF, or Lark where no rule is written with ``::=``) and ``structural_tag``
  (xgrammar's JSON). vLLM gets the field as the client sent it; the decode server compiles
  the same grammar with xgrammar. Per-request options that change how vLLM compiles it
  (``disable_any_whitespace``, ``disable_additional_properties``, ``whitespace_pattern``)
  are refused: both servers compile with the deployment's settings.

Every refusal is a :class:`StructuredOutputError` naming the parameter; schemas are
bounded in size and nesting depth (:class:`SchemaLimits`).

Two depths of check (``compile``): the router checks a grammar's form, bounds and JSON-schema
validity with jsonschema alone, never importing xgrammar (which loads torch and transformers);
the decode server, where the engine and its grammar matcher live, also compiles it. The
structural tag is written here as xgrammar's documented JSON (not with its pydantic classes),
so that building it needs no xgrammar either."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pd_grammar.tool_calls import FunctionTool, tool_call_tag

GrammarKind = Literal["json_schema", "json_object", "structural_tag", "regex", "ebnf", "lark"]
JsonWhitespace = Literal["any", "compact"]
COMPACT_SEPARATORS = (",", ":")


def vllm_structured_outputs_args(whitespace: JsonWhitespace) -> tuple[str, ...]:
    """vLLM's flags for prefill to compile JSON grammars as a decode server with
    ``--json-whitespace whitespace`` does: the xgrammar backend (the decode server's only
    one: no silent fallback to another backend on a schema xgrammar refuses), and with
    ``compact`` no free whitespace between JSON tokens."""
    config = {"backend": "xgrammar", "disable_any_whitespace": whitespace == "compact"}
    return ("--structured-outputs-config", json.dumps(config))
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what vLLM compiles for response_format json_object


class StructuredOutputError(ValueError):
    """The request's structured-output fields cannot be served: an OpenAI 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


DEFAULT_MAX_SCHEMA_BYTES, MAX_SCHEMA_BYTES = 65536, 16 * 1024 * 1024
DEFAULT_MAX_SCHEMA_DEPTH, MAX_SCHEMA_DEPTH = 32, 1000  # JSON nesting; Python's own parser stops near 1000


class SchemaLimits(BaseModel):
    """Bounds on every schema a request brings (``--max-schema-bytes``, ``--max-schema-depth``
    of the router and of the decode server)."""

    model_config = ConfigDict(frozen=True)

    max_bytes: int = Field(default=DEFAULT_MAX_SCHEMA_BYTES, ge=2, le=MAX_SCHEMA_BYTES,
                           description="largest JSON schema (its JSON text, bytes)")
    max_depth: int = Field(default=DEFAULT_MAX_SCHEMA_DEPTH, ge=1, le=MAX_SCHEMA_DEPTH,
                           description="deepest nesting of objects/arrays in a JSON schema")


class GrammarSpec(BaseModel):
    """The grammar one request's output follows; ``source`` is JSON text (a schema or an
    xgrammar structural tag), a regex, or an EBNF / Lark grammar."""

    model_config = ConfigDict(frozen=True)

    kind: GrammarKind
    source: str
    # the grammar holds once the model's reasoning ended (a reasoning parser, thinking on), as
    # vLLM holds it: after a </think>, or from a <tool_call> that ends the reasoning itself
    after_reasoning: bool = False


def _depth(value: Any) -> int:
    depth, level = 0, [value]
    while level:
        nested = [v for item in level if isinstance(item, (dict, list))
                  for v in (item.values() if isinstance(item, dict) else item)]
        if not any(isinstance(item, (dict, list)) for item in level):
            break
        depth += 1
        level = nested
    return depth


def check_schema(schema: Any, param: str, limits: SchemaLimits, compile: bool = True) -> str:
    """A JSON schema, bounded and valid (its metaschema, then, with ``compile``, xgrammar), as JSON text."""
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputError(f"{param} must be a JSON schema (an object), got {type(schema).__name__}", param)
    text = json.dumps(schema, ensure_ascii=False)
    size = len(text.encode())
    if size > limits.max_bytes:
        raise StructuredOutputError(f"{param} is {size} bytes; the largest schema allowed is {limits.max_bytes} "
                                    "bytes", param)
    depth = _depth(schema)
    if depth > limits.max_depth:
        raise StructuredOutputError(f"{param} is nested {depth} levels deep; at most {limits.max_depth} are "
                                    "allowed", param)
    import jsonschema

    try:
        # a $schema jsonschema does not know is checked as draft 2020-12, said explicitly:
        # jsonschema's implicit fallback is deprecated and is to become an error
        latest = jsonschema.Draft202012Validator
        jsonschema.validators.validator_for(schema, default=latest).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise StructuredOutputError(f"{param} is not a valid JSON schema: {exc.message}"
                                    + (f" (at {where})" if where else ""), param) from None
    except Exception as exc:  # e.g. a $schema naming an unknown metaschema, a $ref that does not resolve
        raise StructuredOutputError(f"{param} is not a valid JSON schema: {type(exc).__name__}: {exc}",
                                    param) from None
    if not compile:
        return text
    import xgrammar

    try:
        xgrammar.Grammar.from_json_schema(text, any_whitespace=True)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses of its own
        raise StructuredOutputError(f"{param} is not supported for structured output: {exc}", param) from None
    return text


def _from_response_format(fmt: Any, limits: SchemaLimits, compile: bool) -> GrammarSpec | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise StructuredOutputError("response_format must be an object with a 'type'", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(kind="json_object", source=JSON_OBJECT_SCHEMA)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise StructuredOutputError("response_format.json_schema must be an object with a 'schema'",
                                        "response_format.json_schema")
        text = check_schema(spec["schema"], "response_format.json_schema.schema", limits, compile)
        return GrammarSpec(kind="json_schema", source=text)
    raise StructuredOutputError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                                "response_format.type")


def _function_tools(tools: Any, limits: SchemaLimits, compile: bool) -> list[FunctionTool]:
    """The function tools, in the order given, their schemas checked."""
    if not isinstance(tools, list):
        raise StructuredOutputError("tools must be a list of function tools", "tools")
    out: list[FunctionTool] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise StructuredOutputError(f"tools[{i}] must be a function tool with a name", f"tools[{i}]")
        params = fn.get("parameters")
        if params is not None:
            check_schema(params, f"tools[{i}].function.parameters", limits, compile)
        out.append(FunctionTool(fn["name"], params, fn.get("strict") is True))
    return out


def _tool_mode(choice: Any) -> tuple[str, str | None]:
    """``tool_choice`` as (``auto`` | ``required`` | ``forced`` | ``none``, the named function)."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice or "auto", None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        return "forced", choice["function"]["name"]
    raise StructuredOutputError("tool_choice must be 'none', 'auto', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}", "tool_choice")


def _output_format(spec: GrammarSpec, compile: bool) -> dict[str, Any]:
    """A structured output as a structural tag's format (vLLM's mapping, for ``auto`` tools)."""
    if spec.kind in ("json_schema", "json_object"):
        return {"type": "json_schema", "json_schema": json.loads(spec.source)}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.source}
    if spec.kind == "ebnf":
        return {"type": "grammar", "grammar": spec.source}
    if spec.kind == "lark":  # xgrammar's format takes EBNF: converted where it is compiled
        if not compile:
            return {"type": "grammar", "grammar": spec.source}
        import xgrammar

        return {"type": "grammar", "grammar": str(xgrammar.Grammar.from_lark(spec.source))}
    tag = json.loads(spec.source)
    if "structures" not in tag:
        return dict(tag["format"])
    tags = [{"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
             "end": s["end"]} for s in tag["structures"]]
    return {"type": "triggered_tags", "triggers": tag["triggers"], "tags": tags}


def _from_tools(body: Mapping[str, Any], output: GrammarSpec | None, limits: SchemaLimits,
                compile: bool) -> GrammarSpec | None:
    """The tool calls' grammar (:mod:`pd_grammar.tool_calls`) of a chat with ``tools``, or None
    (no tools, ``tool_choice: "none"``)."""
    tools, (mode, named) = body.get("tools"), _tool_mode(body.get("tool_choice"))
    if mode == "none":
        return None
    if not tools:
        if mode == "auto":
            return None
        raise StructuredOutputError("tool_choice 'required' or a named function needs a non-empty 'tools' list",
                                    "tools")
    functions = _function_tools(tools, limits, compile)
    if named is not None:
        functions = [tool for tool in functions if tool.name == named][:1]
        if not functions:
            raise StructuredOutputError(f"tool_choice names {named!r}, which is not among the tools "
                                        f"{sorted({t['function']['name'] for t in tools})}",
                                        "tool_choice.function.name")
    extra = _output_format(output, compile) if mode == "auto" and output is not None else None
    source = tool_call_tag(functions, mode, body.get("parallel_tool_calls") is False, extra)
    if compile:
        import xgrammar

        try:
            xgrammar.Grammar.from_structural_tag(source)
        except Exception as exc:
            raise StructuredOutputError(f"the tools' parameters cannot be compiled for tool calls: {exc}",
                                        "tools") from None
    return GrammarSpec(kind="structural_tag", source=source)


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# vLLM's StructuredOutputsParams fields that change the compiled grammar per request: refused unless neutral
_COMPILE_OPTIONS = {"disable_any_whitespace": False, "disable_additional_properties": False,
                    "whitespace_pattern": None}
_IGNORED_OPTIONS = ("disable_fallback",)  # backend choice only: ours is always xgrammar


def _bounded_text(value: Any, param: str, limits: SchemaLimits) -> str:
    if not isinstance(value, str) or not value:
        raise StructuredOutputError(f"{param} must be a non-empty string", param)
    if "\x00" in value:
        raise StructuredOutputError(f"{param} must not contain a NUL character", param)
    size = len(value.encode())
    if size > limits.max_bytes:
        raise StructuredOutputError(f"{param} is {size} bytes; at most {limits.max_bytes} are allowed", param)
    return value


def _ebnf_literal(text: str) -> str:
    """``text`` as a double-quoted EBNF string (xgrammar's escapes)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    out = []
    for ch in text:
        if ch in escapes:
            out.append(escapes[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def is_lark(grammar: str) -> bool:
    """Whether a grammar is Lark rather than EBNF: no rule defined with ``::=`` outside comments."""
    return not any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.splitlines())


def _compile_check(spec: GrammarSpec, param: str) -> None:
    """xgrammar's own parse of a regex, EBNF, Lark or structural-tag grammar (the decode server's depth)."""
    import xgrammar

    builders: dict[str, Callable[[str], Any]] = {
        "regex": xgrammar.Grammar.from_regex, "ebnf": xgrammar.Grammar.from_ebnf, "lark": xgrammar.Grammar.from_lark,
        "structural_tag": xgrammar.Grammar.from_structural_tag}
    build = builders[spec.kind]
    try:
        build(spec.source)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses of its own
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        reason = re.sub(r"^\[[\d:]+\] \S+: ", "", first)  # xgrammar's time and source line
        raise StructuredOutputError(f"{param} cannot be compiled: {reason}", param) from None


def _from_structured_outputs(so: Any, limits: SchemaLimits, compile: bool) -> GrammarSpec | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise StructuredOutputError("structured_outputs must be an object", "structured_outputs")
    for key, value in so.items():
        param = f"structured_outputs.{key}"
        if key in _COMPILE_OPTIONS:
            if value not in (None, _COMPILE_OPTIONS[key]):
                raise StructuredOutputError(f"{param} is not supported per request (the servers compile grammars "
                                            "with the deployment's settings)", param)
        elif key not in STRUCTURED_OUTPUT_KINDS and key not in _IGNORED_OPTIONS:
            raise StructuredOutputError(f"{param} is not a structured-outputs field (one of "
                                        f"{', '.join(STRUCTURED_OUTPUT_KINDS)})", param)
    given = [k for k in STRUCTURED_OUTPUT_KINDS if so.get(k) is not None and so.get(k) is not False]
    if len(given) != 1:
        raise StructuredOutputError("structured_outputs must give exactly one of "
                                    f"{', '.join(STRUCTURED_OUTPUT_KINDS)}" + (f" (got {', '.join(given)})"
                                                                               if given else ""),
                                    "structured_outputs")
    kind = given[0]
    param, value = f"structured_outputs.{kind}", so[kind]
    spec: GrammarSpec
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise StructuredOutputError(f"{param} is not JSON: {exc}", param) from None
        return GrammarSpec(kind="json_schema", source=check_schema(value, param, limits, compile))
    if kind == "json_object":
        if value is not True:
            raise StructuredOutputError(f"{param} must be true", param)
        return GrammarSpec(kind="json_object", source=JSON_OBJECT_SCHEMA)
    if kind == "regex":
        spec = GrammarSpec(kind="regex", source=_bounded_text(value, param, limits))
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise StructuredOutputError(f"{param} must be a non-empty list of strings", param)
        source = "root ::= " + " | ".join(_ebnf_literal(c) for c in value)
        spec = GrammarSpec(kind="ebnf", source=_bounded_text(source, param, limits))
    elif kind == "grammar":
        text = _bounded_text(value, param, limits)
        spec = GrammarSpec(kind="lark" if is_lark(text) else "ebnf", source=text)
    else:  # structural_tag: xgrammar's JSON, as text (vLLM's field is a string)
        text = _bounded_text(value if isinstance(value, str) else json.dumps(value), param, limits)
        try:
            tag = json.loads(text)
        except ValueError as exc:
            raise StructuredOutputError(f"{param} is not JSON: {exc}", param) from None
        if not isinstance(tag, dict):
            raise StructuredOutputError(f"{param} must be a JSON object", param)
        spec = GrammarSpec(kind="structural_tag", source=text)
    if compile:
        _compile_check(spec, param)
    return spec


GRAMMAR_FIELDS = ("response_format", "tool_choice", "structured_outputs", "guided_json", "guided_regex",
                  "guided_choice", "guided_grammar")


def asks_for_grammar(body: Mapping[str, Any]) -> bool:
    """Cheap: whether the router checks the request's grammar before prefill: a structured output
    or a forced tool call. A chat's tools with ``tool_choice`` ``auto`` make a grammar too, which
    vLLM's prefill and the decode server build and check: an agent's every turn carries tools,
    and the router leaves their schemas to them."""
    return any(body.get(name) is not None for name in GRAMMAR_FIELDS if name != "tool_choice") \
        or body.get("tool_choice") not in (None, "auto", "none")


def grammar_param(body: Mapping[str, Any], chat: bool) -> str | None:
    """Cheap (nothing compiled or imported): the parameter asking for a grammar, if any;
    what a server that cannot constrain decoding refuses."""
    for name in GRAMMAR_FIELDS[2:]:
        if body.get(name) is not None:
            return name
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return "response_format"
    if chat and body.get("tool_choice") not in (None, "none", "auto"):
        return "tool_choice"
    return None


def warm_up(compiler: bool = True) -> None:
    """Import the schema checker and (``compiler``) xgrammar, which loads transformers:
    seconds, ahead of the first structured request; a server calls it off its event loop
    at start."""
    import jsonschema  # noqa: F401

    if compiler:
        import xgrammar  # noqa: F401


def grammar_spec(body: Mapping[str, Any], limits: SchemaLimits, chat: bool, compile: bool = True) -> GrammarSpec | None:
    """The grammar ``body`` asks for, or None; :class:`StructuredOutputError` when it
    cannot be served. ``compile=False`` (the router): every check but xgrammar's compilation,
    and no import of xgrammar; the same ``source``."""
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if body.get(name) is not None:
            raise StructuredOutputError(f"{name} is not supported; use response_format or structured_outputs", name)
    so = _from_structured_outputs(body.get("structured_outputs"), limits, compile)
    rf = _from_response_format(body.get("response_format"), limits, compile)
    if so is not None and rf is not None:
        raise StructuredOutputError("structured_outputs and response_format cannot be combined: a request follows "
                                    "one grammar", "structured_outputs")
    output = so or rf
    if chat:
        tools = _from_tools(body, output, limits, compile)
        if tools is not None:
            return tools
    return output
