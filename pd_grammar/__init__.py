"""Structured output: what grammar a request asks for, validated before any work runs.

One definition shared by the router (which refuses a bad schema before prefill; vLLM's
prefill builds the same grammar from the request's fields) and the decode server (which compiles it against the
model's vocabulary and masks every step). Imports nothing of ours; xgrammar and
jsonschema only when a request asks for structured output."""
