"""The official `openai` client talks to the sidecar unchanged."""

from __future__ import annotations

import openai
from harness import sidecar_config, url


async def test_openai_client_streaming_and_not(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    client = openai.AsyncOpenAI(base_url=url(s, "/v1"), api_key="unused", max_retries=0)
    try:
        done = await client.completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert done.choices[0].text == "w0 w1 w2"
        assert done.usage is not None and done.usage.completion_tokens == 3

        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        assert "".join(pieces) == "w0 w1 w2 w3"
        assert usage is not None and usage.completion_tokens == 4

        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]

        try:
            await client.completions.create(model="tiny", prompt="hi", max_tokens=-1)
        except openai.BadRequestError as exc:
            assert exc.status_code == 400
            assert "max_tokens" in str(exc)
        else:
            raise AssertionError("a negative max_tokens must be refused")
    finally:
        await client.close()
