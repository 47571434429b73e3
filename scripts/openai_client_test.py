#!/usr/bin/env python3
"""Drives `vllm-rs serve` with the official `openai` Python package, as users' tools do.

Usage: scripts/openai_client_test.py PATH/TO/vllm-rs
Writes a tiny random model, serves it on a free port, runs completions, chat and
streaming through the client, stops the server, and prints 'N passed, M failed'.
"""
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base, proc, limit=120):
    start = time.time()
    while time.time() - start < limit:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during startup ({proc.returncode})")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("server not healthy in time")


def checks(client):
    def completion():
        r = client.completions.create(model="tiny", prompt="Hello world", max_tokens=8, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length", r
        assert r.usage.completion_tokens == 8, r.usage

    def completion_stream():
        kwargs = dict(model="tiny", prompt="Stream me", max_tokens=12, temperature=0.7, seed=5, extra_body={"ignore_eos": True})
        whole = client.completions.create(**kwargs).choices[0].text
        parts = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices]
        assert "".join(parts) == whole, (parts, whole)

    def chat():
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi there"}], max_tokens=6, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].message.role == "assistant", r
        assert r.usage.completion_tokens == 6, r.usage

    def chat_stream():
        kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Tell me"}], max_tokens=10, temperature=0.9, seed=3,
                      extra_body={"ignore_eos": True})
        whole = client.chat.completions.create(**kwargs).choices[0].message.content
        stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
        parts, usage = [], None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                parts.append(c.delta.content or "")
        assert "".join(parts) == whole, (parts, whole)
        assert usage and usage.completion_tokens == 10, usage

    def models():
        ids = [m.id for m in client.models.list()]
        assert ids == ["tiny"], ids

    def bad_request():
        try:
            client.completions.create(model="tiny", prompt="x", top_p=1.5)
        except openai.BadRequestError as e:
            assert "top_p must be in (0, 1]" in str(e), e
        else:
            raise AssertionError("top_p=1.5 was accepted")

    return [completion, completion_stream, chat, chat_stream, models, bad_request]


def main():
    exe = sys.argv[1]
    with tempfile.TemporaryDirectory() as model:
        subprocess.run([exe, "make-tiny-model", "--out", model, "--preset", "tiny-qwen3"], check=True, stdout=subprocess.DEVNULL)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([exe, "serve", "--model", model, "--port", str(port), "--served-model-name", "tiny"],
                                stderr=subprocess.DEVNULL)
        passed = failed = 0
        try:
            wait_healthy(base, proc)
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
            for check in checks(client):
                try:
                    check()
                    passed += 1
                    print(f"ok     {check.__name__}")
                except Exception as e:  # noqa: BLE001 - report every failure, keep going
                    failed += 1
                    print(f"FAILED {check.__name__}: {e!r}")
        finally:
            proc.terminate()
            proc.wait(timeout=15)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
