"""Chat messages -> prompt token ids.

A checkpoint whose tokenizer_config.json has a `chat_template` (Jinja, as Hugging Face
writes it) is rendered with that template in a sandbox, the way the checkpoint was
trained; presets have none, and get a plain template ("role: content" lines, then
"assistant:"), preceded by BOS as a text prompt is. Both are deterministic, so a
session's earlier turns render to the same leading tokens every turn: that is what
makes a conversation's prefix cacheable.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from kvtier.errors import ConfigError


def plain_template(messages: list[dict[str, Any]]) -> str:
    """The template for models without one: one "role: content" block per message; an
    assistant's tool calls follow its content, one `[tool call ID: NAME(ARGUMENTS)]` line each,
    and a tool result's role names its call: `tool (ID): content`."""
    return "".join(_plain(m) for m in messages) + "assistant:"


def _plain(m: dict[str, Any]) -> str:
    role = f"{m['role']} ({m['tool_call_id']})" if "tool_call_id" in m else m["role"]
    calls = "".join(f"\n[tool call {c['id']}: {c['function']['name']}({_text(c['function']['arguments'])})]"
                    for c in m.get("tool_calls", ()))
    return f"{role}: {m['content']}{calls}\n\n"


def _text(arguments: Any) -> str:
    """A tool call's arguments as JSON text (an object written back in its keys' order)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


class ChatFormatter:
    """Renders messages with the checkpoint's chat template, else the plain one."""

    def __init__(self, tokenizer: Any, tokenizer_path: str | Path | None) -> None:
        self.tokenizer = tokenizer
        self._render: Callable[[list[dict[str, Any]]], str] | None = None
        self.source = "plain"
        template = _read_template(tokenizer_path)
        if template is not None:
            self._render = _jinja(template, tokenizer)
            self.source = "checkpoint"

    def token_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        if self._render is None:
            bos = self.tokenizer.bos_token_id
            return ([bos] if bos is not None else []) + self.tokenizer.encode(plain_template(messages))
        return self.tokenizer.encode(self._render(messages))   # the template writes BOS itself


def _read_template(path: str | Path | None) -> str | None:
    if path is None:
        return None
    p = Path(path)
    p = p.parent if p.is_file() else p
    cfg = p / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{cfg}: not readable JSON ({e})") from e
    t = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(t, list):          # [{"name": "default", "template": ...}, ...]
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) and t else None


def _jinja(template: str, tokenizer: Any) -> Callable[[list[dict[str, Any]]], str]:
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ConfigError("this checkpoint has a chat template, which needs jinja2: pip install jinja2") from e

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    names = {}
    for which in ("bos", "eos"):
        tid = getattr(tokenizer, f"{which}_token_id")
        names[f"{which}_token"] = tokenizer.decode([tid], skip_special=False) if tid is not None else ""

    def render(messages: list[dict[str, Any]]) -> str:
        return compiled.render(messages=messages, add_generation_prompt=True, **names)

    return render
