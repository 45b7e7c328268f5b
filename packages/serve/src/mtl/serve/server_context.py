"""What every route of the server reads: the engine loop, the served name, the tokenizer and
the chat template."""

from __future__ import annotations

from dataclasses import dataclass

from mtl.serve.chat import ChatTemplate
from mtl.serve.engine import RequestError
from mtl.serve.engine_loop import EngineLoop


@dataclass(frozen=True)
class ServerContext:
    engine_loop: EngineLoop
    model_name: str
    chat_template: ChatTemplate | None

    @property
    def tokenizer(self):
        return self.engine_loop.engine.tokenizer

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise RequestError(f"model: {name!r} is not served here; this server serves {self.model_name!r}", "model")
