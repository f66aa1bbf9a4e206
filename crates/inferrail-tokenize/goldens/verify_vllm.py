#!/usr/bin/env python3
"""Cross-checks the golden corpus against a real vLLM 0.32.0, in process: no
server and no model weights, only vLLM's own request models and renderer.

Each golden request goes through `ChatCompletionRequest` / `CompletionRequest`
(pydantic validation included) and `OnlineRenderer.render_chat` /
`render_completion`, the code `vllm serve` runs before the engine, and the
prompt token ids (and the rendered text) must equal the golden ones; a golden
error must come back as an error with the same message.

Needs the optional .venv-vllm (crates/inferrail/tests/vllm/setup.sh, 6 GB):

    .venv-vllm/bin/python crates/inferrail-tokenize/goldens/verify_vllm.py

The renderer is built the way `vllm serve` builds it with
`--trust-request-chat-template --enable-auto-tool-choice --tool-call-parser hermes
--max-model-len 2048`. Each family gets a throwaway model folder holding the
tokenizer files and a config.json of the family's model type (no weights).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
TOKENIZERS_DIR = ROOT / ".cache" / "tokenizers"
MAX_MODEL_LEN = 2048

# family -> (model_type, architecture) of the config.json vLLM is given
MODELS = {
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "llama3_1": ("llama", "LlamaForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
}


def model_dir(family: str, base: Path) -> Path:
    from transformers import AutoConfig

    model_type, arch = MODELS[family]
    d = base / family
    d.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(model_type).to_dict()
    config["architectures"] = [arch]
    (d / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        link = d / name
        if not link.exists():
            link.symlink_to(TOKENIZERS_DIR / family / name)
    return d


def build_renderer(path: Path):
    from vllm.config import ModelConfig, VllmConfig
    from vllm.renderers import renderer_from_config
    from vllm.renderers.online_renderer import OnlineRenderer

    model_config = ModelConfig(model=str(path), tokenizer=str(path), max_model_len=MAX_MODEL_LEN)
    vllm_config = VllmConfig(model_config=model_config)
    renderer = renderer_from_config(vllm_config)
    return OnlineRenderer(model_config, renderer, request_logger=None, chat_template=None,
                          chat_template_content_format="auto", trust_request_chat_template=True,
                          enable_auto_tools=True, tool_parser="hermes")


async def run_one(online, rec):
    """(text, ids) the way the engine would get them, or ("error", message)."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    try:
        if rec["endpoint"] == "chat":
            out = await online.render_chat(ChatCompletionRequest(**rec["request"]))
            if isinstance(out, ErrorResponse):
                return "error", out.error.message
            _, engine_inputs = out
        else:
            out = await online.render_completion(CompletionRequest(**rec["request"]))
            if isinstance(out, ErrorResponse):
                return "error", out.error.message
            engine_inputs = out
        # The engine's own check (vllm/v1/engine/input_processor.py _validate_prompt_len).
        for e in engine_inputs:
            if len(e["prompt_token_ids"]) == 0:
                return "error", "The decoder prompt cannot be empty"
    except ValidationError as e:
        causes = [err.get("ctx", {}).get("error") for err in e.errors()]
        msgs = [str(c) for c in causes if c is not None]
        # A plain schema mismatch (no validator message): the golden says only that much.
        return "error", msgs[0] if msgs else f"request validation failed: {str(e).splitlines()[0]}"
    except Exception as e:  # noqa: BLE001 - vLLM answers these with a 400
        return "error", str(e)
    texts = [e.get("prompt") for e in engine_inputs]
    ids = [list(e["prompt_token_ids"]) for e in engine_inputs]
    return texts, ids


def expected(rec):
    if "error" in rec:
        return "error", rec["error"]
    if rec["endpoint"] == "chat":
        return [rec["text"]], [rec["ids"]]
    if rec["ids"] and isinstance(rec["ids"][0], list):
        return rec["text"], rec["ids"]
    return [rec["text"]], [rec["ids"]]


async def check_family(family: str, base: Path) -> int:
    online = build_renderer(model_dir(family, base))
    records = [json.loads(line) for line in (HERE / f"{family}.jsonl").read_text(encoding="utf-8").split("\n") if line.strip()]
    bad = 0
    for rec in records:
        got = await run_one(online, rec)
        want = expected(rec)
        if want[0] == "error" or got[0] == "error":
            # vLLM may append "(parameter=...)" or more detail to the golden message.
            schema = "request validation failed"
            ok = want[0] == got[0] == "error" and (
                want[1] in got[1] or (want[1].startswith(schema) and got[1].startswith(schema)))
        else:
            # Token-id prompts have no text on either side.
            ok = got[1] == want[1] and all(w is None or g == w for g, w in zip(got[0], want[0]))
        if not ok:
            bad += 1
            print(f"MISMATCH {rec['id']} {rec['features']}\n  golden: {str(want)[:600]}\n  vLLM:   {str(got)[:600]}")
    print(f"{family}: {len(records) - bad}/{len(records)} records match vLLM {__import__('vllm').__version__}")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", action="append", choices=sorted(MODELS))
    args = ap.parse_args()
    bad = 0
    with tempfile.TemporaryDirectory(prefix="goldens-vllm-") as tmp:
        for family in args.family or list(MODELS):
            bad += asyncio.run(check_family(family, Path(tmp)))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
