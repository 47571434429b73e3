#!/usr/bin/env python3
"""Writes tests/data/chat_template_ids.json: the reference renderings of the chat templates
of the models in tests/data/models, made the way Hugging Face transformers renders them
(jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, loop controls,
a json.dumps `tojson`, `raise_exception`, `strftime_now`), and the token ids of each
rendering under the real tokenizer.json with no special tokens added (vLLM's way: the
template already holds the bos token).

Needs only `pip install jinja2 tokenizers` (not transformers). Run from the repository root:

    python3 scripts/make_chat_template_ids.py [--models tests/data/models]

The Rust test (frontend/src/chat_template.rs) renders the same conversations with
minijinja and compares text and ids exactly. Llama 3.2's template prints today's date
unless `date_string` is given, so its cases pin `date_string`.
"""

import argparse
import gzip
import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

MODELS = ["Qwen3-0.6B", "Qwen2.5-0.5B-Instruct", "Llama-3.2-1B-Instruct"]
LLAMA_DATE = {"date_string": "05 Mar 2025"}

SYSTEM_USER = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
USER_ONLY = [{"role": "user", "content": "Hello! héllo 世界 🙂"}]
MULTI_TURN = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "  And another one?\n"},
]
ENDS_WITH_ASSISTANT = [
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "Hi there!"},
]
WITH_THINKING = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
    {"role": "user", "content": "3+3?"},
]
CONTENT_PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]},
]
CONTINUE = [
    {"role": "user", "content": "Write a haiku."},
    {"role": "assistant", "content": "Autumn moonlight "},
]


def cases(model):
    extra = LLAMA_DATE if model.startswith("Llama") else {}
    out = [
        ("system_user", SYSTEM_USER, True, False, {}),
        ("user_only", USER_ONLY, True, False, {}),
        ("multi_turn", MULTI_TURN, True, False, {}),
        ("ends_with_assistant_no_generation_prompt", ENDS_WITH_ASSISTANT, False, False, {}),
        ("content_parts", CONTENT_PARTS, True, False, {}),
        ("continue_final_message", CONTINUE, False, True, {}),
    ]
    if model.startswith("Qwen3"):
        out += [
            ("enable_thinking_false", SYSTEM_USER, True, False, {"enable_thinking": False}),
            ("history_with_thinking", WITH_THINKING, True, False, {}),
        ]
    return [(n, m, g, c, {**extra, **k}) for n, m, g, c, k in out]


def compile_template(source):
    """transformers.utils.chat_template_utils._compile_jinja_template, less the
    AssistantTracker extension (it only matters for {% generation %} blocks)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def flatten_content(messages):
    """vLLM's "string" content format: the text parts of a message joined by newlines."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if p.get("type") == "text")
        out.append({**m, "content": content})
    return out


def continue_final(rendered, messages):
    """transformers' continue_final_message: cut the rendering after the final message."""
    final = messages[-1]["content"]
    if final.strip() not in rendered:
        raise ValueError("final message not in the rendering")
    loc = rendered.rindex(final.strip())
    if rendered[loc : loc + len(final.lstrip())] == final:
        return rendered[: loc + len(final.lstrip())]
    return rendered[: loc + len(final.strip())]


def load_tokenizer(folder):
    """tokenizer.json, or the gzipped copy the repository keeps (tests/data/models)."""
    path = os.path.join(folder, "tokenizer.json")
    if os.path.exists(path):
        return Tokenizer.from_file(path)
    with gzip.open(path + ".gz", "rt", encoding="utf-8") as f:
        return Tokenizer.from_str(f.read())


def special_token(config, key):
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=os.path.join(root, "tests", "data", "models"))
    parser.add_argument("--out", default=os.path.join(root, "tests", "data", "chat_template_ids.json"))
    args = parser.parse_args()

    entries = []
    for model in MODELS:
        folder = os.path.join(args.models, model)
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            config = json.load(f)
        template = config["chat_template"]
        if isinstance(template, list):
            template = next(t["template"] for t in template if t["name"] == "default")
        compiled = compile_template(template)
        tokenizer = load_tokenizer(folder)
        specials = {k: v for k in ("bos_token", "eos_token") if (v := special_token(config, k)) is not None}
        for name, messages, add_generation_prompt, continue_final_message, kwargs in cases(model):
            flat = flatten_content(messages)
            text = compiled.render(
                messages=flat, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **specials, **kwargs
            )
            if continue_final_message:
                text = continue_final(text, flat)
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            entries.append(
                {
                    "model": model,
                    "case": name,
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                    "continue_final_message": continue_final_message,
                    "chat_template_kwargs": kwargs,
                    "text": text,
                    "ids": ids,
                }
            )
    with open(args.out, "w") as f:
        json.dump(
            {"generated_by": "scripts/make_chat_template_ids.py", "jinja2": jinja2.__version__, "cases": entries},
            f,
            indent=1,
            ensure_ascii=False,
        )
        f.write("\n")
    print(f"wrote {len(entries)} cases to {args.out}")


if __name__ == "__main__":
    main()
