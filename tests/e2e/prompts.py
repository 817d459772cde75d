"""Prompts for the end-to-end tests: short and long (over 1k tokens), chat and completions,
built from text that ships with Python so every machine has the same prompts."""

from __future__ import annotations

import argparse
import codecs
import difflib
import json
import textwrap

LONG_TEXT = "\n\n".join(textwrap.dedent(mod.__doc__ or "") for mod in (json, textwrap, codecs, difflib, argparse))


def long_prompt(min_chars: int = 6000) -> str:
    text = LONG_TEXT
    while len(text) < min_chars:
        text += "\n\n" + LONG_TEXT
    return text[:min_chars]


COMPLETION_PROMPTS = [
    "The quick brown fox",
    "Beautiful is better than ugly.",
    "def fibonacci(n):",
    long_prompt(6000) + "\nIn summary,",
]

CHAT_PROMPTS = [
    [{"role": "user", "content": "Hello! Who are you?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Explain what JSON is in one sentence."}],
    [{"role": "user", "content": "Write a haiku about Python."}],
    [{"role": "user", "content": long_prompt(5000) + "\n\nSummarize the text above."}],
]
