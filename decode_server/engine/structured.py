"""Structured output on the decode server: a request's :class:`pd_grammar.spec.GrammarSpec`
compiled against the model's vocabulary into a matcher the engine masks with
(:mod:`decode_server.engine.grammar`).

Compiled as vLLM's xgrammar backend compiles the same request: the Hugging Face
tokenizer's vocabulary padded to ``config.json``'s ``vocab_size``; JSON with any
whitespace, or none with ``--json-whitespace compact``, which must match prefill's
``--structured-outputs-config`` (:func:`pd_grammar.spec.vllm_structured_outputs_args`);
the grammar ends with the EOS ids or the request's ``stop_token_ids``; regexes, EBNF and
Lark grammars and structural tags (both of xgrammar's JSON forms) as the backend compiles
them. So the decode server's masks equal prefill's. The compiler is built on first use (loading the
tokenizer takes a moment) and caches compiled grammars."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from decode_server.engine.grammar import AfterReasoning, GrammarMatcher, ThinkingBudget, ThinkingBudgetSpec
from pd_grammar.spec import COMPACT_SEPARATORS, GrammarSpec, JsonWhitespace
from pd_grammar.tool_calls import CALL_BEGIN, THINK_END, THINK_START

CACHE_BYTES = 64 * 1024 * 1024


class GrammarCompiler:
    """One per server (thread-safe). Its matchers roll back any number of tokens (a step's
    rejected MTP drafts): xgrammar 0.2.8's rollback is unlimited, not a setting."""

    def __init__(self, model_dir: Path, whitespace: JsonWhitespace = "any") -> None:
        self._model_dir = Path(model_dir)
        self._compact = whitespace == "compact"
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._reasoning_ends: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())
        self._think_ids = (-1, -1)  # <think>, </think> (-1: not in the vocabulary)

    def _vocab_size(self) -> int:
        cfg_path = self._model_dir / "config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{cfg_path}: no vocab_size, which structured output needs")
        return size

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(self._model_dir))
                vocab = tokenizer.get_vocab()
                # what ends a reasoning block, as GLM's reasoning parser in vLLM reads it: </think>, or
                # a <tool_call> begun inside it (both single special tokens in GLM's vocabulary)
                self._reasoning_ends = (frozenset(vocab[t] for t in (THINK_END,) if t in vocab),
                                        frozenset(vocab[t] for t in (CALL_BEGIN,) if t in vocab))
                # a thinking budget counts the tokens after <think> and forces </think>
                self._think_ids = (vocab.get(THINK_START, -1), vocab.get(THINK_END, -1))
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self._vocab_size())
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                                          cache_limit_bytes=CACHE_BYTES)
            return self._compiler

    def matcher(self, spec: GrammarSpec | None, stop_token_ids: Iterable[int],
                budget: ThinkingBudgetSpec | None = None) -> GrammarMatcher:
        """A fresh matcher at the grammar's start (``spec``), within the thinking ``budget``
        (:class:`~decode_server.engine.grammar.ThinkingBudget`); one of them at least."""
        inner = None if spec is None else self._grammar(spec, stop_token_ids)
        if budget is None:
            if inner is None:
                raise ValueError("a matcher needs a grammar or a thinking budget")
            return inner
        self._get()
        start, end = self._think_ids
        return ThinkingBudget(inner, budget.tokens, start, end, reasoning_open=budget.last_prompt_token_id == start)

    def _grammar(self, spec: GrammarSpec, stop_token_ids: Iterable[int]) -> GrammarMatcher:
        import xgrammar

        compiler = self._get()
        if spec.kind == "structural_tag":
            compiled = _compile_structural_tag(compiler, spec.source)
        elif spec.kind == "regex":
            compiled = compiler.compile_regex(spec.source)
        elif spec.kind == "ebnf":
            compiled = compiler.compile_grammar(spec.source)
        elif spec.kind == "lark":
            compiled = compiler.compile_lark(spec.source)
        else:
            compiled = compiler.compile_json_schema(spec.source, any_whitespace=not self._compact,
                                                    separators=COMPACT_SEPARATORS if self._compact else None)
        stops = sorted(set(stop_token_ids))
        matcher: GrammarMatcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        if spec.after_reasoning:
            explicit, implicit = self._reasoning_ends
            return AfterReasoning(matcher, explicit, implicit)
        return matcher


def _compile_structural_tag(compiler: Any, source: str) -> Any:
    """A structural tag in xgrammar's current JSON (``{"type": "structural_tag", "format": ...}``),
    or in the older one vLLM still reads (``structures`` with ``begin``/``schema``/``end``, and
    ``triggers``), compiled as vLLM's xgrammar backend compiles each."""
    import xgrammar

    tag = json.loads(source)
    if "structures" not in tag:
        return compiler.compile_structural_tag(source)
    items = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
             for s in tag["structures"]]
    return compiler.compile_structural_tag(items, tag["triggers"])
