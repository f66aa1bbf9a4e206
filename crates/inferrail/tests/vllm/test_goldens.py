"""Inferrail's Qwen3 tokenization (crates/inferrail-tokenize/goldens/qwen3.jsonl)
against a real vLLM: the prompt token count vLLM reports for each golden
request, the exact prompt ids it served (`return_token_ids`) and those its
/tokenize returns, and the cached tokens its prefix cache reports, which follow
from the ids at block granularity.

Each golden line is {"id", "endpoint": "chat" | "completions", "request",
"text", "ids"} (for a list of prompts, "ids" is a list of lists), or carries
"error" for a request Inferrail refuses, which vLLM must refuse too. The
server runs with every flag a record's "server_flags" names."""

import json
import os
import re
import uuid
from pathlib import Path

import pytest

# Matches conftest.py: the server runs with --block-size 32 under this name.
BLOCK_SIZE = 32
SERVED = "tiny-qwen3"
ROOT = Path(__file__).resolve().parents[4]
GOLDENS = Path(os.environ.get("INFERRAIL_GOLDENS", ROOT / "crates" / "inferrail-tokenize" / "goldens" / "qwen3.jsonl"))
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def load_goldens():
    if not GOLDENS.exists():
        return []
    return [json.loads(line) for line in GOLDENS.read_text().splitlines() if line.strip()]


ALL = load_goldens()
RECORDS = [r for r in ALL if "error" not in r]
REFUSED = [r for r in ALL if "error" in r]


def is_batch(rec):
    """A completions request with a list of prompts: one id list per prompt."""
    return bool(rec["ids"]) and isinstance(rec["ids"][0], list)


def prompts(rec):
    return rec["ids"] if is_batch(rec) else [rec["ids"]]


def params(select=lambda r: True, records=RECORDS):
    chosen = [pytest.param(r, id=r["id"]) for r in records if select(r)]
    # An empty golden file must not pass quietly.
    return chosen or [pytest.param(None, id="no-goldens")]


def refused_params():
    if not RECORDS:
        return params(records=REFUSED)
    return [pytest.param(r, id=r["id"]) for r in REFUSED]  # none is no failure


def need(rec, vllm=None):
    if rec is None:
        pytest.fail(f"no usable records in {GOLDENS} (missing, empty or all errors)")
    if vllm is not None:
        missing = [f for f in rec.get("server_flags") or [] if f not in vllm.flags]
        assert not missing, f"{rec['id']} needs vLLM flags {missing} the test server lacks (conftest.py)"


def body_for(rec, salt=None):
    """The golden request as sent to vLLM: one greedy token, no streaming."""
    body = dict(rec["request"], model=SERVED, max_tokens=1, temperature=0, stream=False)
    for key in ("stream_options", "max_completion_tokens", "n", "best_of"):
        body.pop(key, None)
    if salt is not None:
        body["cache_salt"] = salt
    return body


def send(vllm, rec, salt=None):
    r = vllm.post(PATHS[rec["endpoint"]], body_for(rec, salt))
    assert r.status == 200, f"{rec['id']}: vLLM answered {r.status}: {r.body[:2000]!r}"
    return r.json()["usage"]


def first_difference(a, b):
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at {i}: golden {a[max(0, i - 3):i + 5]} vs vLLM {b[max(0, i - 3):i + 5]} (lengths {len(a)} and {len(b)})"


def fully_cached(n):
    """What vLLM reports for an n-token prompt whose every block it holds: whole
    blocks only, and never the last prompt token, which it always recomputes."""
    return (n - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_server_is_the_engine_the_goldens_assume(vllm):
    assert vllm.get("/version").json()["version"] == "0.32.0"
    metrics = vllm.get("/metrics").body.decode()
    info = re.search(r"^vllm:cache_config_info\{(.*)\} ", metrics, re.M)
    assert info and f'block_size="{BLOCK_SIZE}"' in info.group(1), info and info.group(1)
    assert 'enable_prefix_caching="True"' in info.group(1), info.group(1)


@pytest.mark.parametrize("rec", params())
def test_prompt_tokens_match_goldens(vllm, rec):
    need(rec, vllm)
    usage = send(vllm, rec)
    # For a list of prompts vLLM sums the prompt tokens over the list.
    expected = sum(len(ids) for ids in prompts(rec))
    assert usage["prompt_tokens"] == expected, f"{rec['id']}: vLLM prompt_tokens {usage['prompt_tokens']}, golden {expected}"


@pytest.mark.parametrize("rec", params())
def test_prompt_ids_match_goldens(vllm, rec):
    """The exact prompt ids the engine got, from the serving path itself
    (`return_token_ids`): per choice for completions, in prompt order."""
    need(rec, vllm)
    r = vllm.post(PATHS[rec["endpoint"]], dict(body_for(rec), return_token_ids=True))
    assert r.status == 200, f"{rec['id']}: vLLM answered {r.status}: {r.body[:2000]!r}"
    reply = r.json()
    if rec["endpoint"] == "chat":
        got = [reply["prompt_token_ids"]]
    else:
        got = [c["prompt_token_ids"] for c in sorted(reply["choices"], key=lambda c: c["index"])]
    want = prompts(rec)
    assert len(got) == len(want), f"{rec['id']}: {len(got)} prompts from vLLM, {len(want)} golden"
    for i, (w, g) in enumerate(zip(want, got)):
        assert g == w, f"{rec['id']} prompt {i}: {first_difference(w, g)}"


# Request fields vLLM 0.32's /tokenize drops although /v1/chat/completions
# renders them (seen: its ids lack the documents and the empty think block).
TOKENIZE_IGNORES = {"documents", "reasoning_effort"}


def tokenizable(rec):
    """/tokenize takes chat messages or a single string prompt (a list is refused)."""
    if TOKENIZE_IGNORES & set(rec["request"]):
        return False
    return rec["endpoint"] == "chat" or isinstance(rec["request"].get("prompt"), str)


@pytest.mark.parametrize("rec", params(tokenizable))
def test_tokenize_ids_match_goldens(vllm, rec):
    need(rec, vllm)
    # The whole request body, so that tools, add_generation_prompt,
    # continue_final_message, chat_template and chat_template_kwargs reach the
    # template; /tokenize ignores sampling fields.
    body = body_for(rec)
    r = vllm.post("/tokenize", body)
    assert r.status == 200, f"{rec['id']}: /tokenize answered {r.status}: {r.body[:2000]!r}"
    got = r.json()["tokens"]
    assert got == rec["ids"], f"{rec['id']}: {first_difference(rec['ids'], got)}"


@pytest.mark.parametrize("rec", params())
def test_cached_tokens_on_repeat(vllm, rec):
    """Sent twice under a fresh cache salt, a request finds all its full blocks
    but the one holding its last token. For a list of prompts, vLLM reports the
    cached tokens of the last prompt only (not the sum)."""
    need(rec, vllm)
    salt = uuid.uuid4().hex
    first = send(vllm, rec, salt)
    second = send(vllm, rec, salt)
    last = prompts(rec)[-1]
    if not is_batch(rec):
        assert first["prompt_tokens_details"]["cached_tokens"] == 0, rec["id"]
    got = second["prompt_tokens_details"]["cached_tokens"]
    assert got == fully_cached(len(last)), f"{rec['id']}: vLLM cached_tokens {got}, expected {fully_cached(len(last))} for a {len(last)}-token prompt"


def test_cached_tokens_across_goldens(vllm):
    """Every single-prompt golden in order under one cache salt: what each finds
    cached is the longest run of whole blocks its golden ids share with a prompt
    sent before it. This holds only if the golden ids equal vLLM's, token for
    token, up to every block boundary, across chat and completions alike."""
    singles = [r for r in RECORDS if not is_batch(r)]
    need(singles[0] if singles else None)
    salt = uuid.uuid4().hex
    held = set()  # token-id prefixes of whole blocks vLLM holds under this salt
    mismatches = []
    for rec in singles:
        need(rec, vllm)
        ids = rec["ids"]
        hit = 0
        while hit + BLOCK_SIZE <= len(ids) - 1 and tuple(ids[:hit + BLOCK_SIZE]) in held:
            hit += BLOCK_SIZE
        got = send(vllm, rec, salt)["prompt_tokens_details"]["cached_tokens"]
        if got != hit:
            mismatches.append(f"{rec['id']}: vLLM cached_tokens {got}, golden ids predict {hit}")
        held.update(tuple(ids[:end]) for end in range(BLOCK_SIZE, len(ids) + 1, BLOCK_SIZE))
    assert not mismatches, f"{len(mismatches)} of {len(singles)} differ:\n" + "\n".join(mismatches)


@pytest.mark.parametrize("rec", refused_params())
def test_refused_goldens_are_refused_by_vllm(vllm, rec):
    """What Inferrail declines to tokenize, vLLM refuses too, with the same
    message, except where vLLM's request validation fails: it lists every
    alternative of every union it tried, which the golden sums up in a line."""
    need(rec, vllm)
    r = vllm.post(PATHS[rec["endpoint"]], body_for(rec))
    assert r.status == 400, f"{rec['id']}: vLLM answered {r.status}: {r.body[:2000]!r}"
    message = r.json()["error"]["message"]
    if rec["error"].startswith("request validation failed:"):
        assert "validation error" in message, f"{rec['id']}: vLLM says {message!r}, golden {rec['error']!r}"
    else:
        assert rec["error"] in message, f"{rec['id']}: vLLM says {message!r}, golden {rec['error']!r}"
