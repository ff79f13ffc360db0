"""gpt-oss's Harmony output on the chat route: with `gpt-oss` as the
--reasoning-parser or the --tool-call-parser, each choice's text is read by
the Rust HarmonyParser (rust/text/chat/harmony/), which splits it into
reasoning (the analysis channel), content (the final channel and
preambles) and tool calls (commentary messages to `functions.NAME`).

The channel markers are special tokens of gpt-oss's tokenizer, so these
requests are detokenized with the special tokens kept; the parser drops
the markers. Reasoning is separated only under `--reasoning-parser gpt-oss`
and `separate_reasoning` (the default); otherwise the analysis text stays
in the content, where an unsplit reasoning block is. Calls are read under
`--tool-call-parser gpt-oss` with tools and tool_choice "auto".
"""

from __future__ import annotations

from pyserve._rust import HarmonyParser
from pyserve.api.generation.tool_grammar import CallDelta
from pyserve.api.generation.tools import HARMONY, ToolCalling

# Where a constrained answer (a response_format, forced calls) starts: the
# final channel's body, after the analysis.
FINAL_MESSAGE = "<|channel|>final<|message|>"


def reads_harmony(reasoning_parser: str | None, tool_call_parser: str | None) -> bool:
    """Whether the server's output is read as Harmony."""
    return HARMONY in (reasoning_parser, tool_call_parser)


class HarmonyOutput:
    """One choice's Harmony text in, (reasoning, content, call deltas) out."""

    def __init__(self, separate_reasoning: bool, calling: ToolCalling | None):
        read_calls = calling is not None and calling.parser == HARMONY
        functions = [t["function"]["name"] for t in calling.tools] if read_calls and calling.tools else None
        self.parser = HarmonyParser(functions, read_calls)
        self.separate_reasoning = separate_reasoning

    def feed(self, text: str, final: bool) -> tuple[str, str, list[CallDelta]]:
        reasoning, content, calls = self.parser.feed(text)
        if final:
            r, c, more = self.parser.flush()
            reasoning, content, calls = reasoning + r, content + c, calls + more
        if not self.separate_reasoning:
            reasoning, content = "", reasoning + content
        return reasoning, content, calls
