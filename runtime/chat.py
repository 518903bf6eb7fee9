"""A chat's orchestration, written once for `LLM.chat` (runtime/api.py) and the server's chat
and responses endpoints (serve/chat.py):

    Chat.of   the options checked (FieldError naming the field): tools, tool_choice, the
              template's variables (runtime/reasoning.py), how the chat is rendered; the call
              format read from the template (runtime/tool_formats.py)
    encode    the messages through the template, the tools shown in its format
    hold      the params held to the call grammar (tool_choice required or named), and any
              structure only after the thinking section; with the answer's `Reading`

The server keeps what is HTTP's: its fields mapped onto `Chat.of`, a FieldError as a 400,
and the Shape that streams the answer from the Reading.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from trt_spec.runtime import reasoning, tool_calls
from trt_spec.runtime.generator import encode_prompt
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.tokenizer import Tokenizer
from trt_spec.runtime.tool_calls import FORMATS, Format, Tool, ToolCall, ToolChoice
from trt_spec.runtime.tool_formats import format_of
from trt_spec.runtime.validation import FieldError

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # vLLM's


@dataclass(frozen=True)
class Reading:
    """How a chat's answer reads."""

    fmt: Format  # the template's call format (tool_formats.format_of)
    tools: list[Tool]  # what the answer may call; empty: it calls nothing (tool_choice none)
    held: bool  # the output is held to the call grammar (tool_choice required or named)
    # None: the answer does not think (no thinking section, or turned off); else whether the
    # prompt opened the think block (the output starts inside it)
    think: bool | None

    def read(self, text: str) -> tuple[str | None, str, list[ToolCall] | None]:
        """A finished answer's (reasoning, content, calls): reasoning None where it did not
        think; calls None where it made none, else content is the text before them."""
        thought, content = ((None, text) if self.think is None
                            else reasoning.split(text, self.think))
        if not self.tools:
            return thought, content, None
        before, calls = self.fmt.parse(content, self.tools, self.held)
        return (thought, before, calls) if calls else (thought, content, None)


PLAIN = Reading(FORMATS["block"], [], False, None)  # an answer as it is: no calls, no thinking


@dataclass(frozen=True)
class Chat:
    """A chat's options, checked, for one tokenizer (its template)."""

    tokenizer: Tokenizer
    tools: list[Tool]
    choice: ToolChoice
    parallel: bool  # parallel_tool_calls: an output held to calls may make several
    variables: dict  # the template's variables asked for (enable_thinking, ...)
    rendering: dict  # add_generation_prompt, continue_final_message, documents
    fmt: Format

    @classmethod
    def of(cls, tokenizer: Tokenizer, tools=None, tool_choice=None,
           parallel_tool_calls: bool = True, chat_template_kwargs=None, *,
           reasoning_effort=None, add_generation_prompt=None, continue_final_message=None,
           documents=None) -> Chat:
        """OpenAI's and vLLM's chat fields, checked in that order; None takes each default.
        FieldError naming the field."""
        given = [] if tools is None else tool_calls.tools(tools)
        choice = tool_calls.tool_choice(tool_choice, given)
        return cls(tokenizer, given, choice, parallel_tool_calls,
                   variables(chat_template_kwargs, reasoning_effort),
                   rendering(add_generation_prompt, continue_final_message, documents),
                   format_of(tokenizer.template_text(given)))

    def encode(self, messages: list[dict]) -> list[int]:
        """The prompt ids (generator.encode_prompt). ValueError: no template, or it refused."""
        return encode_prompt(self.tokenizer, messages, True, self.tools,
                             {**self.variables, **self.rendering})

    def hold(self, prompt_ids: list[int], params: SamplingParams,
             structure_field: str | None = None) -> tuple[SamplingParams, Reading]:
        """(the params the answer is sampled with, how it reads): held to the call grammar
        (tool_choice required or named), a structure only after the thinking section.
        structure_field: the caller's name for params' structure, which errors name."""
        if structure_field is None and params.structure is not None:
            structure_field = f"sampling_params.{params.structure[0]}"
        if self.choice.forced:
            params = self.held_to_calls(params, structure_field)
        think = reasoning.thinking_of(self.tokenizer, self.variables, prompt_ids)
        if think is not None and params.structure is not None:
            field = "tools" if self.choice.forced else structure_field
            try:
                params = reasoning.after_thinking(params, think)
            except FieldError as e:
                raise FieldError(field, f"{field} after the thinking section: {e}") from None
        tools = self.tools if self.choice.mode != "none" else []
        return params, Reading(self.fmt, tools, self.choice.forced, think)

    def held_to_calls(self, params: SamplingParams, named: str | None) -> SamplingParams:
        """The output held to the grammar of the allowed calls (and to no other structure)."""
        if params.structure is not None:
            asked = ("required" if self.choice.mode == "required"
                     else f"the function {self.choice.name!r}")
            raise FieldError("tool_choice", f"tool_choice ({asked}) holds the output to tool "
                                            f"calls; it cannot also be held to {named}")
        grammar = self.fmt.grammar(self.tools, self.choice, self.parallel,
                                   self.tokenizer.marker_ids(self.fmt.markers))
        try:
            return dataclasses.replace(params, grammar=grammar)
        except FieldError as e:
            raise FieldError("tools", f"the tools' schemas: {e}") from None


def variables(chat_template_kwargs, reasoning_effort: str | None) -> dict:
    """chat_template_kwargs, checked, and reasoning_effort's: the template reads it by that
    name, and "none" turns thinking off (enable_thinking false, unless the kwargs set it),
    any other effort on."""
    given = reasoning.template_kwargs(chat_template_kwargs)
    if reasoning_effort is None:
        return given
    if reasoning_effort not in EFFORTS:
        raise FieldError("reasoning_effort", f"reasoning_effort={reasoning_effort!r}: must "
                                             f"be one of {', '.join(EFFORTS)}")
    return {"enable_thinking": reasoning_effort != "none", "reasoning_effort": reasoning_effort,
            **given}


def rendering(add_generation_prompt: bool | None, continue_final_message: bool | None,
              documents) -> dict:
    """How the chat is rendered (vLLM's fields): add_generation_prompt (default true),
    continue_final_message (the last message left open for the model to go on with; not with
    add_generation_prompt), documents (the template's)."""
    if continue_final_message and add_generation_prompt:
        raise FieldError("continue_final_message", "continue_final_message and "
                         "add_generation_prompt are both true: a chat either opens a new "
                         "assistant turn or continues its last message; set "
                         "add_generation_prompt false")
    options = {"add_generation_prompt": not continue_final_message
               and add_generation_prompt is not False}
    if continue_final_message:
        options["continue_final_message"] = True
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise FieldError("documents", f"documents={json.dumps(documents)[:80]}: expected "
                                          "a list of objects (e.g. {\"title\", \"text\"})")
        options["documents"] = documents
    return options
