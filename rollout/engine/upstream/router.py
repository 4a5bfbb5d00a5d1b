"""RolloutRouter: delivers every finished or failed request to one callback on the engine thread, instead of the
shared queue whose `get_result` shuffles concurrent consumers."""

from __future__ import annotations

from collections.abc import Callable

from transformers.generation.continuous_batching.continuous_api import OutputRouter
from transformers.generation.continuous_batching.requests import GenerationOutput


class RolloutRouter(OutputRouter):
    """Routes every output to one callback (called on the engine thread)."""

    def __init__(self, callback: Callable[[GenerationOutput], None]) -> None:
        super().__init__()
        self.callback = callback

    def deliver(self, output: GenerationOutput) -> None:
        self.callback(output)

    def deliver_batch(self, outputs: list[GenerationOutput]) -> None:
        for output in outputs:
            self.callback(output)
