"""The official OpenAI Python SDK, sync and async, streaming and not, against
the simulator: its responses must parse as the SDK's own types."""

import asyncio

import openai
import pytest

SYSTEM = "You are a terse assistant that answers in one line. " * 8


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_models_list(sim_url):
    models = client(sim_url).models.list()
    assert [m.id for m in models.data] == ["sim"]
    assert models.data[0].owned_by == "vllm"


def test_chat_whole_and_cached_on_repeat(sim_url):
    c = client(sim_url)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
    first = c.chat.completions.create(model="sim", messages=messages, max_tokens=7)
    assert first.object == "chat.completion"
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 7
    again = c.chat.completions.create(model="sim", messages=messages, max_tokens=3)
    n = again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16


def test_chat_stream_with_usage(sim_url):
    stream = client(sim_url).chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "Count."}], max_tokens=5,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) >= 1
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_completions_whole_and_stream(sim_url):
    c = client(sim_url)
    whole = c.completions.create(model="sim", prompt="Once upon a time", max_tokens=4)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 4
    pieces = [ch.choices[0].text for ch in c.completions.create(model="sim", prompt="Once", max_tokens=3, stream=True)]
    assert len(pieces) == 3


def test_async_client_streams_concurrently(sim_url):
    async def run():
        c = openai.AsyncOpenAI(base_url=f"{sim_url}/v1", api_key="unused", max_retries=0)

        async def one(i):
            stream = await c.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": f"request {i}"}], max_tokens=6, stream=True)
            return [chunk async for chunk in stream]

        results = await asyncio.gather(*(one(i) for i in range(20)))
        await c.close()
        return results

    for chunks in asyncio.run(run()):
        assert chunks[-1].choices[0].finish_reason == "length"


def test_errors_raise_the_sdks_exceptions(sim_url):
    c = client(sim_url)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert "does not exist" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="sim", messages=[{"role": "user", "content": "x"}], max_tokens=10_000)
    assert "max_tokens" in e.value.message
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="sim", messages=[{"role": "user", "content": "x"}], n=2)
