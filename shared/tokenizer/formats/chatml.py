"""ChatML (SmolLM2): `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n` per message.

Without tools the rendering is byte-identical to SmolLM2's own Jinja template, default system
prompt included (it is read from the template by `format_for`): every message in order, the
system prompt inserted when the first message is not a system message, and
`<|im_start|>assistant\\n` as the generation prompt.

SmolLM2's template knows no tools, and `<tool_call>` is plain text in its vocabulary. Tools
follow the Hermes / Qwen2.5 convention, the one open chat models are most often tuned on:
- a `# Tools` section appended to the system prompt (the first message's when it is a system
  message, else the default one), listing each tool as one JSON line inside
  `<tools></tools>` and asking for `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`;
- an assistant turn's calls as `<tool_call>\\n{"name": "N", "arguments": ARGS}\\n</tool_call>`
  blocks, ARGS the arguments text verbatim (PC-04), one call per block, joined by "\\n" and
  set off from any text content by "\\n";
- tool results as one `user` turn of `<tool_response>\\nRESULT\\n</tool_response>` blocks
  joined by "\\n", consecutive tool messages sharing the turn.
tool_choice "required" / a named function opens the call after the generation prompt:
`<tool_call>\\n{"name": "` / `<tool_call>\\n{"name": "NAME", "arguments": `.

Segments: the only control tokens are `<|im_start|>` and `<|im_end|>`; the role and content
between them are one text run. An assistant body is its own run starting right after
`assistant\\n`, the point where generation starts, so the generation prompt's ids plus the
model's ids are a prefix of the next turn (PC-01). The whole-string tokenization differs from
that only for a body that begins with whitespace (`"\\n" + "  x"` pre-tokenizes differently
from `"\\n  x"`), and there the split is the one the model generated.

Prefix property (PC-01) holds at every message boundary except between two consecutive tool
messages: a lone result closes its turn, a second one extends it.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from shared.tokenizer.chat import Chat, Message
from shared.tokenizer.formats.base import (
    Body,
    ChatFormat,
    Segment,
    SegmentBuilder,
    Text,
    tool_json,
)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class ChatML(ChatFormat):
    name = "chatml"
    MARKERS = (IM_START, IM_END)
    STOP_MARKERS = (IM_END,)

    def __init__(self, tokenizer: Tokenizer, *, default_system_prompt: str = "") -> None:
        super().__init__(tokenizer)
        self.default_system_prompt = default_system_prompt

    def render(self, chat: Chat, *, add_generation_prompt: bool = True) -> list[Segment]:
        self.validate(chat)
        out = SegmentBuilder()
        messages = chat.messages
        tools = self.rendered_tools(chat)
        has_system = bool(messages) and messages[0].role == "system"
        if tools:
            head = messages[0].content if has_system else self.default_system_prompt
            tool_lines = "".join("\n" + tool_json(tool) for tool in tools)
            system = (head + "\n\n" if head else "") + TOOLS_INTRO + tool_lines + TOOLS_OUTRO
            self._turn(out, "system", system)
            messages = messages[1:] if has_system else messages
        elif messages and not has_system and self.default_system_prompt:
            self._turn(out, "system", self.default_system_prompt)
        index = 0
        while index < len(messages):
            message = messages[index]
            if message.role == "tool":
                results = []
                while index < len(messages) and messages[index].role == "tool":
                    results.append(f"<tool_response>\n{messages[index].content}\n</tool_response>")
                    index += 1
                self._turn(out, "user", "\n".join(results))
                continue
            if message.role == "assistant":
                out.control(self.control(IM_START))
                out.text("assistant\n")
                out.body(self.render_body(message))
                out.control(self.control(IM_END))
                out.text("\n")
            else:
                self._turn(out, message.role, message.content)
            index += 1
        if add_generation_prompt:
            out.control(self.control(IM_START))
            out.text("assistant\n")
            out.split()  # the forced opening belongs to the body the model goes on with
            out.extend(self.forced_segments(chat))
        return out.build()

    def render_body(self, message: Message) -> Body:
        blocks = [
            f'<tool_call>\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n</tool_call>'
            for call in message.tool_calls
        ]
        pieces = [message.content] if message.content else []
        if blocks:
            pieces.append("\n".join(blocks))
        text = "\n".join(pieces)
        return Body((Text(text),) if text else ())

    def forced_segments(self, chat: Chat) -> list[Segment]:
        choice = chat.tool_choice
        if choice.mode == "required":
            return [Text('<tool_call>\n{"name": "')]
        if choice.mode == "function":
            return [Text(f'<tool_call>\n{{"name": "{choice.name}", "arguments": ')]
        return []

    def _turn(self, out: SegmentBuilder, role: str, content: str) -> None:
        out.control(self.control(IM_START))
        out.text(f"{role}\n{content}")
        out.control(self.control(IM_END))
        out.text("\n")
