"""The stages of DeepSeek V4/V4.1 output and what each one matches: the grammar of the stream parser.

    reasoning --</think>--> common (answer text) --<｜DSML｜--> tool_calls --invoke name="--> tool_name
    tool_name --"--> args --parameter name=--> param_name --" --> param_type --true">/false">--> param_value
    param_value --</｜DSML｜--> args (next parameter, or </｜DSML｜ closes the invoke) --> tool_calls
    tool_calls --</｜DSML｜tool_calls>--> finished;  common/json --stop sequence--> finished

DSML tool calls become JSON argument text as they stream: `parameter name=` opens the object ("{") or
continues it (", "), the quoted name is copied through as the key, a space after it writes ": ", a string
value is quoted and JSON-escaped, any other value is copied raw (the model writes it as JSON), and the
closing tag writes "}" ("{}" for no parameters). V4 spells the tags `tool_calls` / `invoke` / `parameter`,
V4.1 `" calls"` / `" invoke"` / `" parameter"`; both are accepted for either model, as deepseek-recipe does.

JSON mode (`parse_json_output`): a fenced block (```json / ```) or a bare `{` / `[` starts the JSON, and
every run of text around it becomes one space. Stop sequences apply to answer text and JSON, never to
reasoning or tool-call markup.

Token mode: when the output arrives as token ids, an added-vocabulary token (`</think>`, `｜DSML｜`, ...) is
one opaque symbol, not its spelling: the patterns spell `</think>` and `｜DSML｜` with the symbols below, so
ordinary tokens that happen to spell `</think>` ("</" "think" ">") stay text and a lone "</" token is never
held as the start of one. Text chunks (text mode) match spellings, as deepseek-recipe does with text.

Deliberate deviation from deepseek-recipe 0.2.0: a parameter name ends at the space after its closing quote,
not at its first space (0.2.0 turns name="shipping address" into `{"shipping: ...`, broken JSON), and a
backslash or control character in a name is escaped.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from services.recipe.parse.machine import LEADING, NL_STR, QUOTE_SPACE, STR, Act, Branch, Stage, stage
from services.recipe.parse.machine import branch as make_branch

DSML_BEGIN = "<｜DSML｜"
DSML_END = "</｜DSML｜"
TOOL_CALLS_END = ("</｜DSML｜tool_calls>", "</｜DSML｜ calls>")
THINK_END = "</think>"
JSON_FENCES = ("```json\n", "```\n")
JSON_BARE = ("{", "[")
JSON_END = "\n```"

# Token mode symbols: lone surrogates never occur in decoded text, so they cannot collide with it.
THINK_END_SYM = "\udc00"
DSML_SYM = "\udc01"
OPAQUE_SYM = "\udcff"  # every other added token: matches nothing
SYMBOLS = {THINK_END: THINK_END_SYM, "｜DSML｜": DSML_SYM}

# Actions (see machine.Act): what a segment of input becomes.
RAW = Act("raw")  # answer text as is
TO_SPACE = Act("to_space")  # JSON mode: text around the JSON, one space per delta
SKIP = Act("skip")
SKIP_INVALID = Act("skip_invalid")  # a stray </think> in the answer, text after the end
REASONING = Act("reasoning")
TOOL_BEGIN = Act("tool_begin")
TOOL_NAME = Act("tool_name")
TOOL_NAME_END = Act("tool_name_end")
ARGS_RAW = Act("args_raw")  # a non-string parameter value, copied as JSON
ARGS_STR = Act("args_str")  # a string parameter value, JSON-escaped
ARGS_KEY = Act("args_key")  # a parameter name with its quotes
OPEN_OBJECT = Act("args_label", "{")
NEXT_KEY = Act("args_label", ", ")
COLON = Act("args_label", ": ")
OPEN_STRING = Act("args_label", '"')
CLOSE_STRING = Act("args_label", '"')
EMPTY_OBJECT = Act("args_label", "{}")
CLOSE_OBJECT = Act("args_label", "}")
JSON_LABELS = {c: Act("label", c) for c in JSON_BARE}

# Stage keys.
FINISHED = ("finished",)
JSON = ("json",)
MATCHED_JSON = ("matched_json",)
TOOL_CALLS = ("tool_calls",)
TOOL_NAME_STAGE = ("tool_name",)
PARAM_NAME = ("param_name",)
PARAM_TYPE = ("param_type",)
PLAIN = ("plain",)


def common(leading: bool) -> tuple[str, bool]:
    return ("common", leading)


def reasoning(leading: bool) -> tuple[str, bool]:
    return ("reasoning", leading)


def args(leading: bool) -> tuple[str, bool]:
    return ("args", leading)


def param_value(string: bool) -> tuple[str, bool]:
    return ("param_value", string)


def stop_action(sequence: str) -> Act:
    return Act("stop", sequence)


def symbolize(text: str) -> str:
    """A pattern in token mode: the spellings of `</think>` and `｜DSML｜` become symbols."""
    for spelling, sym in SYMBOLS.items():
        if spelling in text:
            text = text.replace(spelling, sym)
    return text


@lru_cache(maxsize=256)
def build(tools: bool, json_output: bool, stops: tuple[str, ...], token_mode: bool = False) -> dict[object, Stage]:
    """Every stage for one set of parsing options (cached: requests share a handful of option sets)."""
    if token_mode:
        return _build(tools, json_output, stops, symbolize)
    return _build(tools, json_output, stops, lambda s: s)


def _build(tools: bool, json_output: bool, stops: tuple[str, ...], sym: Callable[[str], str]) -> dict[object, Stage]:
    def branch(kind: int, pattern: str, next_stage: object, action: Act) -> Branch:
        return make_branch(kind, sym(pattern), next_stage, action)

    stop_branches = [branch(STR, s, FINISHED, stop_action(s)) for s in stops if s]
    dsml = [branch(NL_STR, DSML_BEGIN, TOOL_CALLS, SKIP)] if tools else []
    table: dict[object, Stage] = {}
    for leading in (True, False):
        first: list[Branch] = []
        if json_output:
            first += [branch(STR, f, JSON, SKIP) for f in JSON_FENCES]
            first += [branch(STR, c, JSON, JSON_LABELS[c]) for c in JSON_BARE]
        else:
            first += stop_branches
        lead = [branch(LEADING, "\n", common(True), SKIP)] if leading else []
        think = [branch(STR, THINK_END, common(False), SKIP_INVALID)]
        table[common(leading)] = stage(first + dsml + lead + think, TO_SPACE if json_output else RAW)

        lead = [branch(LEADING, "\n", reasoning(leading), SKIP)] if leading else []
        end = [branch(NL_STR, THINK_END, common(True), SKIP)]
        table[reasoning(leading)] = stage(dsml + lead + end, REASONING)

        table[args(leading)] = stage(
            [
                branch(STR, "parameter name=", PARAM_NAME, OPEN_OBJECT if leading else NEXT_KEY),
                branch(STR, DSML_END, TOOL_CALLS, EMPTY_OBJECT if leading else CLOSE_OBJECT),
            ],
            SKIP,
        )
    table[JSON] = stage([*stop_branches, branch(STR, JSON_END, MATCHED_JSON, SKIP)], RAW)
    table[MATCHED_JSON] = stage(dsml, TO_SPACE)
    table[TOOL_CALLS] = stage(
        [branch(STR, 'invoke name="', TOOL_NAME_STAGE, TOOL_BEGIN)]
        + [branch(STR, end, FINISHED, SKIP) for end in TOOL_CALLS_END],
        SKIP,
    )
    table[TOOL_NAME_STAGE] = stage([branch(STR, '"', args(True), TOOL_NAME_END)], TOOL_NAME)
    table[PARAM_NAME] = stage([branch(QUOTE_SPACE, " ", PARAM_TYPE, COLON)], ARGS_KEY)
    table[PARAM_TYPE] = stage(
        [branch(STR, 'true">', param_value(True), OPEN_STRING), branch(STR, 'false">', param_value(False), SKIP)],
        SKIP,
    )
    for string in (True, False):
        table[param_value(string)] = stage(
            [branch(STR, DSML_END, args(False), CLOSE_STRING if string else SKIP)], ARGS_STR if string else ARGS_RAW
        )
    table[FINISHED] = stage([], SKIP_INVALID)
    table[PLAIN] = stage(stop_branches, RAW)
    return table


def initial_stage(starts_in_tool_calls: bool, thinking_initial_stage: str | None) -> object:
    if starts_in_tool_calls:
        return TOOL_CALLS
    return {
        None: common(True),
        "reasoning_start": reasoning(True),
        "reasoning_continuation": reasoning(False),
        "content_continuation": common(False),
    }[thinking_initial_stage]
