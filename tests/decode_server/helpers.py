"""Request builders for the decode-server tests."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import openai
from tokenizers import Tokenizer


def handoff(first_token_id: int, num_prompt_tokens: int = 7, last_prompt_token_id: int = 3,
            **extra: Any) -> dict[str, Any]:
    return {"handoff_id": f"h-{uuid.uuid4().hex[:12]}", "kv_endpoint": "127.0.0.1:1",
            "num_prompt_tokens": num_prompt_tokens,
            "first_token_id": first_token_id, "last_prompt_token_id": last_prompt_token_id, "status": "sent",
            **extra}


def script_for(tok: Tokenizer, text: str, eos: bool = True) -> tuple[int, list[int]]:
    """(first token, the rest) of ``text`` (+ EOS)."""
    ids = tok.encode(text).ids
    if eos:
        ids.append(tok.token_to_id("<|endoftext|>"))
    return ids[0], ids[1:]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)


def sse_events(response: httpx.Response) -> list[Any]:
    """Parsed ``data:`` events of an SSE response ("[DONE]" kept as a string)."""
    events: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
