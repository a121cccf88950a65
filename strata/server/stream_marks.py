"""The resume marks of one stream (strata/protocol/resume.py): SSE comment lines that tell the
gateway the prompt ids and every output's token ids, so that it can resume the stream on another
instance. A stream started here carries a start mark on its first frame; a resumed one does not
(the gateway has it). Every output gets a frame, a mark alone when it released no text.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.engine.outputs import RequestOutput
from strata.protocol.resume import mark_frame, start_mark, tokens_mark


@dataclass(slots=True)
class Marks:
    start: bytes = b""  # until the first frame takes it

    @classmethod
    def first(cls, *, id: str, created: int, version: str, prompt_token_ids: list[int]) -> Marks:
        """The marks of a stream that starts here (`version`: name@version served here)."""
        return cls(start_mark(id=id, created=created, version=version,
                              prompt_token_ids=prompt_token_ids))

    def first_frame(self, frame: bytes) -> bytes:
        """`frame` with the start mark, if it has not gone out yet."""
        start, self.start = self.start, b""
        return mark_frame(start, frame)

    def on(self, output: RequestOutput, frame: bytes) -> bytes:
        """The frame of `output` (b"" when it released nothing) with its tokens mark."""
        finish = output.finish_reason.value if output.finished and output.finish_reason else None
        return self.first_frame(mark_frame(
            tokens_mark(output.new_token_ids, finish, output.stop_reason), frame))


__all__ = ["Marks"]
