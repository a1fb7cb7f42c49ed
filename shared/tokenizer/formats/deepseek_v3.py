"""DeepSeek-V3 (tiny-coder): byte-identical to tiny-coder's template
(models/tiny_coder/tokenizer.py CHAT_TEMPLATE) for every conversation it renders.

That template, and so this renderer: BOS, then every system message joined by blank lines;
`<｜User｜>CONTENT` per user message; an assistant message opens with `<｜Assistant｜>`, or with
`<｜tool▁outputs▁end｜>` right after tool results, drops the reasoning before a `</think>`,
writes its calls as `<｜tool▁calls▁begin｜>` + `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
\\n```json\\nARGS\\n```<｜tool▁call▁end｜>` blocks joined by "\\n" + `<｜tool▁calls▁end｜>`, and
ends with EOS; tool results are `<｜tool▁output▁begin｜>RESULT<｜tool▁output▁end｜>` after one
`<｜tool▁outputs▁begin｜>` per round. Conversations that end in tool results close them with
`<｜tool▁outputs▁end｜>` (even without a generation prompt), and that marker is then the
generation prompt: the model continues straight after it. On the conversations DeepSeek-V3's
official template renders correctly (one tool round, no `</think>` in tool-calling turns)
both give the same text; tiny-coder's template fixes V3's multi-round bugs (see there).

V3's template renders no tool definitions. They follow vLLM's convention for DeepSeek: a
`# Tools` section appended to the system prompt, one JSON line per tool inside
`<tools></tools>`, then the call format spelled with the real markers (they are skeleton, so
they are control ids). tool_choice "required" opens a call after the generation prompt
(`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>`), a named function
also writes `NAME\\n```json\\n`.

Prefix property (PC-01): the template itself breaks it in four places, kept for byte
identity: a system message after the first turn moves to the front; the
`<｜tool▁outputs▁end｜>` closing a conversation that ends in a tool result moves when a
second result follows, and goes when a user message follows; reasoning before `</think>` is
dropped from history.
"""

from __future__ import annotations

from shared.tokenizer.chat import Chat, Message
from shared.tokenizer.formats.base import (
    Body,
    ChatFormat,
    Segment,
    SegmentBuilder,
    tool_json,
)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
OUTPUTS_END = "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"
SEP = "<｜tool▁sep｜>"
THINK_END = "</think>"

TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_OUTRO = "\n</tools>\n\nTo call functions, write one block per call in this format:\n"


class DeepSeekV3(ChatFormat):
    name = "deepseek-v3"
    MARKERS = (
        BOS,
        EOS,
        USER,
        ASSISTANT,
        CALLS_BEGIN,
        CALLS_END,
        CALL_BEGIN,
        CALL_END,
        OUTPUTS_BEGIN,
        OUTPUTS_END,
        OUTPUT_BEGIN,
        OUTPUT_END,
        SEP,
    )
    STOP_MARKERS = (EOS,)

    def render(self, chat: Chat, *, add_generation_prompt: bool = True) -> list[Segment]:
        self.validate(chat)
        out = SegmentBuilder()
        out.control(self.control(BOS))
        self._system(out, chat)
        is_tool, is_output_first = False, True
        for message in chat.messages:
            if message.role == "user":
                is_tool = False
                out.control(self.control(USER))
                out.text(message.content)
            elif message.role == "assistant":
                out.control(self.control(OUTPUTS_END if is_tool else ASSISTANT))
                is_tool = False
                out.body(self.render_body(message))
                out.control(self.control(EOS))
                is_output_first = True
            elif message.role == "tool":
                is_tool = True
                if is_output_first:
                    out.control(self.control(OUTPUTS_BEGIN))
                    is_output_first = False
                out.control(self.control(OUTPUT_BEGIN))
                out.text(message.content)
                out.control(self.control(OUTPUT_END))
        if is_tool:
            out.control(self.control(OUTPUTS_END))
        if add_generation_prompt:
            if not is_tool:
                out.control(self.control(ASSISTANT))
            out.extend(self.forced_segments(chat))
        return out.build()

    def render_body(self, message: Message) -> Body:
        content = message.content
        if THINK_END in content:
            content = content.split(THINK_END)[-1]
        out = SegmentBuilder()
        out.text(content)
        if message.tool_calls:
            out.control(self.control(CALLS_BEGIN))
            for index, call in enumerate(message.tool_calls):
                if index:
                    out.text("\n")
                self._call(out, call.name, call.arguments)
            out.control(self.control(CALLS_END))
        return Body(tuple(out.build()))  # type: ignore[arg-type]  # no Body inside a body

    def forced_segments(self, chat: Chat) -> list[Segment]:
        choice = chat.tool_choice
        if choice.mode not in ("required", "function"):
            return []
        out = SegmentBuilder()
        out.control(self.control(CALLS_BEGIN, CALL_BEGIN))
        out.text("function")
        out.control(self.control(SEP))
        if choice.mode == "function":
            out.text(f"{choice.name}\n```json\n")
        return out.build()

    def _call(self, out: SegmentBuilder, name: str, arguments: str) -> None:
        out.control(self.control(CALL_BEGIN))
        out.text("function")
        out.control(self.control(SEP))
        out.text(f"{name}\n```json\n{arguments}\n```")
        out.control(self.control(CALL_END))

    def _system(self, out: SegmentBuilder, chat: Chat) -> None:
        # As the template: a system message adds "\n\n" only after a non-empty prompt.
        prompt = ""
        for message in chat.messages:
            if message.role == "system":
                prompt = (prompt + "\n\n" if prompt else "") + message.content
        tools = self.rendered_tools(chat)
        if tools:
            prompt = (prompt + "\n\n" if prompt else "") + TOOLS_INTRO
            prompt += "".join("\n" + tool_json(tool) for tool in tools) + TOOLS_OUTRO
            out.text(prompt)
            out.control(self.control(CALLS_BEGIN))
            self._call(out, "FUNCTION_NAME", '{"param": "value"}')
            out.control(self.control(CALLS_END))
        else:
            out.text(prompt)
