"""Chat messages -> prompt text with the chat template shipped in the checkpoint's tokenizer files.

Hugging Face tokenizers keep the template in ``tokenizer_config.json`` (``chat_template``: a
string, or a list of named templates of which ``default`` is used) or in ``chat_template.jinja``
beside it; it is a Jinja template over ``messages`` and ``add_generation_prompt``, rendered here
in Jinja's sandbox as ``transformers`` does."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mtl.core.errors import MtlError


class NoChatTemplate(MtlError):
    """The tokenizer has no chat template (HTTP 400 on /v1/chat/completions)."""


def _special(config: dict, name: str) -> str:
    value = config.get(name) or ""
    return value.get("content", "") if isinstance(value, dict) else value


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                        eos_token=self.eos_token)
        except TemplateError as exc:
            raise ValueError(f"messages: the chat template refused them: {exc}") from None

    @classmethod
    def from_tokenizer_files(cls, tokenizer_path: str | None) -> "ChatTemplate | None":
        """The template beside ``tokenizer_path`` (a tokenizer file or its folder), else None."""
        if tokenizer_path is None:
            return None
        folder = Path(tokenizer_path)
        folder = folder if folder.is_dir() else folder.parent
        config_path, jinja_path = folder / "tokenizer_config.json", folder / "chat_template.jinja"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if source is None and jinja_path.is_file():
            source = jinja_path.read_text(encoding="utf-8")
        if not source:
            return None
        return cls(source, _special(config, "bos_token"), _special(config, "eos_token"))


def _raise(message: str):
    raise TemplateError(message)
