"""From a validated OpenAI request to what one generation needs: engine sampling
parameters, stop conditions, output options. Every rejection is an OpenAI 400
naming the parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

from decode_server.engine.base import SamplingParams
from decode_server.server.api_errors import InvalidRequest, KVHandoffFailed
from decode_server.server.sequence import MIN_LOGPROB, StopSpec, TokenLogprob
from decode_server.server.text import GenerationDefaults
from pd_grammar.spec import GrammarSpec, SchemaLimits, StructuredOutputError, grammar_param, grammar_spec
from pd_grammar.tool_calls import MARKERS
from pd_wire.decode import EngineFeatures
from pd_wire.handoff import PROTOCOL_VERSION, HandoffClaim, HandoffResult, ResumeFrom
from pd_wire.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    Endpoint,
    logit_bias,
    over_context,
    unsupported,
)


@dataclass(frozen=True)
class ServerLimits:
    max_seq_len: int
    features: EngineFeatures
    engine: str
    model_name: str
    reasoning_parser: bool = False
    tool_call_parser: bool = False
    schema_limits: SchemaLimits = SchemaLimits()


ToolChoiceKind = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class Plan:
    endpoint: Endpoint
    request_id: str
    handoff: HandoffResult | HandoffClaim  # a claim until the result came with the KV (:func:`with_result`)
    sampling: SamplingParams
    stop: StopSpec
    stream: bool
    include_usage: bool
    continuous_usage: bool
    model: str
    logprobs: int | None  # None: off; k: chosen token + top k
    tokens_as_ids: bool
    reasoning: bool
    tools: list[dict[str, Any]] | None  # parse tool calls when not None
    first_tool_call_only: bool  # parallel_tool_calls false: later calls are dropped from the answer
    first_logprob: TokenLogprob | None
    grammar: GrammarSpec | None = None  # structured output (the engine gets its matcher)
    thinking_budget: int | None = None  # vLLM's thinking_token_budget (the engine's matcher forces </think>)
    # how the calls were asked for (the finish reason and content follow it, as in vLLM): "auto", or a
    # call forced ("required", "named"); None without tools
    tool_choice: ToolChoiceKind | None = None
    asked_max_tokens: tuple[int | None, str, int] = (None, "max_tokens", 0)  # (asked, its param, max_seq_len)
    progress: bool = False  # progress lines before each write (HandoffClaim.progress)
    created: int | None = None  # the answer's ``created`` (None: now)
    resume: ResumeFrom | None = None  # continues a sequence cut elsewhere (HandoffClaim.resume)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length as the client's usage counts it (a resumed sequence's KV also
        holds the output before the cut)."""
        return self.resume.prompt_tokens if self.resume is not None else self.result.num_prompt_tokens

    @property
    def handoff_id(self) -> str:
        return self.handoff.handoff_id

    @property
    def result(self) -> HandoffResult:
        """The handoff's result (the plan of a claim has it once :func:`with_result` ran)."""
        if not isinstance(self.handoff, HandoffResult):
            raise RuntimeError(f"handoff {self.handoff.handoff_id!r}: its result has not come yet")
        return self.handoff


def _check_handoff(handoff: HandoffResult | HandoffClaim) -> None:
    if handoff.protocol_version != PROTOCOL_VERSION:
        raise InvalidRequest(
            f"kv_transfer_params.protocol_version is {handoff.protocol_version}, this server speaks "
            f"{PROTOCOL_VERSION}", "kv_transfer_params.protocol_version")
    if isinstance(handoff, HandoffResult) and handoff.status == "failed":
        raise KVHandoffFailed(f"prefill reported the KV handoff {handoff.handoff_id!r} as failed: "
                            f"{handoff.error or 'no reason given'}", "kv_transfer_params.status")


def _logprobs_k(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return (req.top_logprobs or 0) if req.logprobs else None


def _max_tokens(asked: int | None, param: str, prompt_tokens: int, max_seq_len: int) -> int:
    room = max_seq_len - prompt_tokens
    if room < 1:
        raise InvalidRequest(f"This model's maximum context length is {max_seq_len} tokens; the prompt has "
                             f"{prompt_tokens} tokens, which leaves no room for output", "messages")
    if asked is None:
        return room
    if asked > room:
        raise InvalidRequest(
            f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
            f"{prompt_tokens + asked} tokens ({prompt_tokens} in the prompt, {asked} in the completion). "
            f"Please reduce the length of the prompt or of {param}.", param)
    return asked


def with_result(plan: Plan, result: HandoffResult) -> Plan:
    """The plan of a claim, completed by the result that came with the KV or was posted: the
    output's bound now that the prompt's length is known (a 400 when it leaves no room), and
    from a posted result the first token's logprobs and the prompt's ids."""
    _check_handoff(result)
    if result.handoff_id != plan.handoff_id:
        raise KVHandoffFailed(f"the KV channel delivered handoff {result.handoff_id!r} for {plan.handoff_id!r}",
                            "kv_transfer_params.handoff_id")
    if plan.sampling.repetition_penalty != 1.0 and result.prompt_token_ids is None:
        raise InvalidRequest("repetition_penalty needs the prompt's token ids: the posted result's "
                             "prompt_token_ids (the router asks prefill for them)",
                             "kv_transfer_params.prompt_token_ids")
    asked, param, max_seq_len = plan.asked_max_tokens
    resume = plan.resume
    if resume is not None:
        return _resumed(plan, result, resume)
    max_tokens = _max_tokens(asked, param, result.num_prompt_tokens, max_seq_len)
    # a posted result (the router's, from vLLM's answer) carries what such a request needs
    prompt_ids = tuple(result.prompt_token_ids or ()) if plan.sampling.repetition_penalty != 1.0 else ()
    first_logprob = (prefill_logprob(result.prefill_logprobs, plan.logprobs) if plan.logprobs is not None
                     else None)
    return replace(plan, handoff=result, first_logprob=first_logprob,
                   sampling=replace(plan.sampling, max_tokens=max_tokens, prompt_token_ids=prompt_ids),
                   stop=replace(plan.stop, max_tokens=max_tokens))


def _resumed(plan: Plan, result: HandoffResult, resume: ResumeFrom) -> Plan:
    """:func:`with_result` for a sequence resumed from a cut: the KV holds the original prompt and
    the output so far; the bounds are the original request's (the output so far runs through the
    stop conditions again, :class:`~decode_server.server.sequence.SequenceProcessor`), the engine
    decodes what remains of them."""
    done = len(resume.output_token_ids)
    if result.num_prompt_tokens != resume.prompt_tokens + done:
        raise KVHandoffFailed(f"the KV of resumed handoff {result.handoff_id!r} holds {result.num_prompt_tokens} "
                              f"tokens, not the prompt's {resume.prompt_tokens} and the {done} output tokens",
                              "kv_transfer_params.resume")
    if plan.sampling.repetition_penalty != 1.0 and resume.prompt_token_ids is None:
        raise InvalidRequest("repetition_penalty needs the prompt's token ids: kv_transfer_params.resume."
                             "prompt_token_ids", "kv_transfer_params.resume.prompt_token_ids")
    asked, param, max_seq_len = plan.asked_max_tokens
    max_tokens = _max_tokens(asked, param, resume.prompt_tokens, max_seq_len)
    prompt_ids = tuple(resume.prompt_token_ids or ()) if plan.sampling.repetition_penalty != 1.0 else ()
    return replace(plan, handoff=result, first_logprob=None,
                   sampling=replace(plan.sampling, max_tokens=max(1, max_tokens - done), prompt_token_ids=prompt_ids,
                                    resumed_from=tuple(resume.output_token_ids)),
                   stop=replace(plan.stop, max_tokens=max_tokens))


def _tool_choice_kind(choice: Any) -> ToolChoiceKind:
    if choice == "required":
        return "required"
    return "named" if isinstance(choice, dict) else "auto"


def _grammar(req: CompletionRequest | ChatCompletionRequest, limits: ServerLimits) -> GrammarSpec | None:
    """The request's structured output (pd_grammar: the router checks the same before prefill)."""
    fields: dict[str, Any] = dict(req.model_extra or {})
    chat = isinstance(req, ChatCompletionRequest)
    if isinstance(req, ChatCompletionRequest):
        fields.update(tools=req.tools, tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls)
        if not limits.tool_call_parser and req.tool_choice in (None, "auto"):
            fields.pop("tools")  # no parser, no calls to constrain (vLLM constrains them for its parser)
    if not limits.features.structured_output:
        param = grammar_param(fields, chat)
        if param is not None:
            raise InvalidRequest(f"{param}: constrained decoding is not supported by the {limits.engine} engine",
                                 param)
        return None
    try:
        return grammar_spec(fields, limits.schema_limits, chat=chat)
    except StructuredOutputError as exc:
        raise InvalidRequest(exc.message, exc.param) from None


def build_plan(endpoint: Endpoint, req: CompletionRequest | ChatCompletionRequest, request_id: str,
               limits: ServerLimits, defaults: GenerationDefaults) -> Plan:
    refusal = unsupported(req, limits.features, limits.engine)
    if refusal is not None:
        raise InvalidRequest(refusal.message, refusal.param)
    bias = logit_bias(req.logit_bias)
    out_of_vocab = sorted(t for t, _ in bias if defaults.vocab_size and t >= defaults.vocab_size)
    if out_of_vocab:  # vLLM's check (the sampler would index past the logits)
        raise InvalidRequest(f"token_id(s) {out_of_vocab[:8]} in logit_bias contain out-of-vocab token ids. "
                             f"Vocabulary size: {defaults.vocab_size}", "logit_bias")
    grammar = _grammar(req, limits)
    handoff = req.kv_transfer_params
    if handoff is None:  # the route checks it first; here for a caller that did not
        raise InvalidRequest("kv_transfer_params is required", "kv_transfer_params")
    _check_handoff(handoff)
    k = _logprobs_k(req)
    asked, param = req.asked_max_tokens()
    no_room = over_context(req, limits.max_seq_len)
    if isinstance(handoff, HandoffResult):
        max_tokens = _max_tokens(asked, param, handoff.num_prompt_tokens, limits.max_seq_len)
    elif no_room is not None:  # whatever the prompt, known when the KV lands
        raise InvalidRequest(no_room.message, no_room.param)
    else:  # checked against the prompt's length when it comes with the KV (with_result)
        max_tokens = asked if asked is not None else limits.max_seq_len - 1
    dflt = defaults.sampling
    temperature = req.temperature if req.temperature is not None else dflt.temperature
    top_k = req.top_k if req.top_k is not None else dflt.top_k
    repetition = _or(req.repetition_penalty, dflt.repetition_penalty, 1.0)
    claim = handoff if isinstance(handoff, HandoffClaim) else None
    needs_answer = k is not None or repetition != 1.0
    if claim is not None and claim.resume is None and claim.result == "with_kv" and needs_answer:
        needs = "logprobs" if k is not None else "repetition_penalty"
        raise InvalidRequest(f"{needs} needs the prefill's answer (the first token's logprobs, the prompt's token "
                             "ids): send kv_transfer_params as the HandoffResult, or a claim whose result is "
                             "posted", needs)
    if isinstance(handoff, HandoffResult) and repetition != 1.0 and handoff.prompt_token_ids is None:
        raise InvalidRequest("repetition_penalty needs the prompt's token ids: kv_transfer_params.prompt_token_ids "
                             "(the router asks prefill for them)", "kv_transfer_params.prompt_token_ids")
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else float(temperature),
        top_p=float(req.top_p if req.top_p is not None else (dflt.top_p or 1.0)),
        top_k=0 if top_k is None or top_k < 0 else int(top_k),
        seed=req.seed,
        logprobs=k,
        min_p=_or(req.min_p, dflt.min_p, 0.0),
        presence_penalty=_or(req.presence_penalty, dflt.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, dflt.frequency_penalty, 0.0),
        repetition_penalty=repetition,
        logit_bias=bias,
        prompt_token_ids=(tuple(handoff.prompt_token_ids or ())
                          if isinstance(handoff, HandoffResult) and repetition != 1.0 else ()),
    )
    stop = StopSpec(
        max_tokens=max_tokens,
        eos_token_ids=defaults.eos_token_ids,
        stop_token_ids=frozenset(req.stop_token_ids or ()),
        stop_strings=tuple(req.stop_list()),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
    )
    chat = isinstance(req, ChatCompletionRequest)
    tools = None
    if isinstance(req, ChatCompletionRequest) and req.tools and req.tool_choice != "none" and (
            limits.tool_call_parser or (grammar is not None and grammar.kind == "structural_tag")):
        tools = req.tools  # a forced call is parsed as GLM's calls whatever --tool-call-parser says
    thinking = req.thinking() if isinstance(req, ChatCompletionRequest) else True
    reasoning = chat and limits.reasoning_parser and thinking
    if grammar is not None and limits.reasoning_parser and thinking:
        # as vLLM with a reasoning parser: the grammar holds once the reasoning ended (a completions
        # prompt is taken as opening one, as vLLM reads a prompt that does not close it)
        grammar = grammar.model_copy(update={"after_reasoning": True})
    if tools is not None or reasoning:  # GLM's markers are special tokens: the parser sees them and no
        # other special token, whatever skip_special_tokens says (as vLLM's GLM parser)
        stop = replace(stop, skip_special_tokens=True, keep_special=frozenset(MARKERS))
    return Plan(
        endpoint=Endpoint(endpoint), request_id=request_id, handoff=handoff, sampling=sampling, stop=stop,
        stream=bool(req.stream), include_usage=bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=bool(req.stream_options and req.stream_options.include_usage
                              and req.stream_options.continuous_usage_stats),
        model=req.model or limits.model_name, logprobs=k, tokens_as_ids=bool(req.return_tokens_as_token_ids),
        reasoning=reasoning, tools=tools,
        first_tool_call_only=isinstance(req, ChatCompletionRequest) and req.parallel_tool_calls is False,
        tool_choice=_tool_choice_kind(req.tool_choice) if isinstance(req, ChatCompletionRequest) and tools else None,
        first_logprob=(prefill_logprob(handoff.prefill_logprobs, k)
                       if k is not None and isinstance(handoff, HandoffResult) else None),
        grammar=grammar, thinking_budget=_thinking_budget(req, limits),
        asked_max_tokens=(asked, param, limits.max_seq_len),
        progress=claim is not None and claim.progress,
        created=claim.created if claim is not None else None,
        resume=claim.resume if claim is not None else None,
    )


def _thinking_budget(req: CompletionRequest | ChatCompletionRequest, limits: ServerLimits) -> int | None:
    """The request's ``thinking_token_budget``; refused, as vLLM refuses it, by a server that
    reads no reasoning (no ``--reasoning-parser``)."""
    budget = req.thinking_token_budget
    if budget is not None and not limits.reasoning_parser:
        raise InvalidRequest("thinking_token_budget is set but reasoning_config is not configured. Please set "
                             "--reasoning-parser and/or --reasoning-config to use thinking_token_budget.",
                             "thinking_token_budget")
    return budget


def _or(value: float | None, default: float | None, neutral: float) -> float:
    """The request's value, else the checkpoint's default, else vLLM's neutral value."""
    return float(value if value is not None else default if default is not None else neutral)


def prefill_logprob(data: dict[str, Any] | None, k: int | None) -> TokenLogprob | None:
    """The first token's logprobs from prefill's ``choices[0].logprobs`` (either shape)."""
    if not data:
        return None
    k = k or 0
    try:
        if isinstance(data.get("content"), list):  # chat shape
            entry = data["content"][0]
            top = [(t["token"], float(t["logprob"])) for t in entry.get("top_logprobs") or []]
            return TokenLogprob(entry["token"], _finite(entry.get("logprob")), tuple(top[:k]))
        tokens = data.get("tokens") or []
        if tokens:  # completions shape
            lps = data.get("token_logprobs") or [None]
            tops = data.get("top_logprobs") or [None]
            top_d = tops[0] or {}
            top = sorted(((t, float(v)) for t, v in top_d.items()), key=lambda x: -x[1])
            return TokenLogprob(tokens[0], _finite(lps[0]), tuple(top[:k]))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"kv_transfer_params.prefill_logprobs is malformed: {exc!r}",
                             "kv_transfer_params.prefill_logprobs") from exc
    return None


def _finite(value: Any) -> float | None:
    if value is None:
        return None
    v = float(value)
    return v if math.isfinite(v) else MIN_LOGPROB
