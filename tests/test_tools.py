"""Tool use, from data to serving: `sft prepare` on the conversational tools shape (ours and a
model's own template that renders tools; the loss on calls and answers, never on results; the
generated sample set), and `serve` answering OpenAI's `tools` / `tool_choice` /
`parallel_tool_calls` (constrained calls that always validate, the openai client's tool loop
streamed and not, what is still refused)."""
from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from tests.conftest import run_stage, write_config
from tests.test_sft import TOK_NAME, tokenizer
from utils.data import chat, sft, tool_samples, tools

# a Hermes-style template (Qwen2.5's way of writing tools and calls, shortened): it renders tools
HERMES = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for t in tools %}\n{{ t.function | tojson }}{%- endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
# one that does not: transformers hands it the tools and it leaves them out
PLAIN = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
         "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def _chat_tok():
    """The sample tokenizer with <|im_start|> / <|im_end|> as special tokens (a copy)."""
    tok = copy.deepcopy(tokenizer())
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.pipeline_chat_view = None
    return tok


def _masked_text(tok, ids, mask) -> str:
    return tok.decode([t for t, k in zip(ids, mask) if k], skip_special_tokens=False)


# --------------------------------------------------------------------------- sft prepare
@pytest.fixture(scope="module")
def tools_data(tmp_path_factory, samples):
    root = tmp_path_factory.mktemp("tools_sft")
    cfg = write_config(root, {"tokenizer": {"name": TOK_NAME}})
    p = run_stage("sft", "prepare", "--config", cfg, "--dataset", "tools")
    assert p.returncode == 0, p.stdout + p.stderr
    return {"root": root, "cfg": cfg, "out": p.stdout, "dir": root / "data" / "post-training"}


def test_prepare_on_the_generated_set_trains_on_calls_and_answers_never_on_results(tools_data):
    tok = tokenizer()
    ex = sft.load_examples(tools_data["dir"])
    meta = ex.meta
    assert meta["source"]["kind"] == "generated_tools" and "GENERATED" in meta["source"]["label"]
    assert "GENERATED" in tools_data["out"]
    assert meta["counts"]["with_tools"] == meta["counts"]["kept"] > 150
    source = [json.loads(line) for line in (tools_data["dir"] / meta["source"]["copy"]).read_text().splitlines()]
    assert len(source) == meta["counts"]["considered"]
    n_calls = 0
    for i in range(len(ex)):
        ids, mask = ex.example(i)
        trained = _masked_text(tok, ids, mask)
        shown = tok.decode(list(map(int, ids)), skip_special_tokens=False)
        assert "Tool: " not in trained and '"content":' not in trained and "Tools:" not in trained
        n_calls += trained.count(tools.CALL_OPEN)
        if tools.CALL_OPEN in shown:       # a call is trained on, its results are shown, not trained on
            assert tools.CALL_OPEN in trained and "Tool: {" in shown
        # every trained call parses and names a listed tool with arguments valid for it
        for body in trained.split(tools.CALL_OPEN)[1:]:
            call = json.loads(body.split(tools.CALL_CLOSE)[0])
            fn, schema = tool_samples.FUNCTIONS[call["name"]]
            jsonschema.validate(call["arguments"], schema)
            fn(**call["arguments"])                          # the functions really run on them
    assert n_calls > len(ex)


def test_the_generated_set_is_the_same_each_time_and_its_results_are_the_functions_own():
    a, b = tool_samples.records(40, seed=3), tool_samples.records(40, seed=3)
    assert a == b and a != tool_samples.records(40, seed=4)
    for r in a:
        msgs = tools.read_messages(r["messages"])
        calls = {c["id"]: c["function"] for m in msgs for c in m.get("tool_calls", ())}
        for m in msgs:
            if m["role"] == "tool":
                fn = calls[m["tool_call_id"]]
                assert json.loads(m["content"]) == tool_samples.FUNCTIONS[fn["name"]][0](**fn["arguments"])
    assert tool_samples.is_prime(97) and not tool_samples.is_prime(91)
    assert tool_samples.weekday("2024-02-29") == "Thursday" and tool_samples.days_between("2024-01-01", "2024-03-01") == 60


def test_a_jsonl_of_openai_shaped_tool_conversations_and_its_bad_records_named(tmp_path, samples):
    fn = {"type": "function", "function": {"name": "get_weather", "description": "weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    good = {"tools": [fn], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C, snow"},
        {"role": "assistant", "content": "It is -3 C and snowing in Oslo."}]}
    bad_tool = {"tools": [fn], "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"},
                                            {"role": "assistant", "content": "y"}]}
    unlisted = {"tools": [], "messages": [good["messages"][1], good["messages"][2], good["messages"][3],
                                          good["messages"][4]]}
    bad_args = json.loads(json.dumps(good))
    bad_args["messages"][2]["tool_calls"][0]["function"]["arguments"] = "{city: Oslo"
    src = tmp_path / "tools.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in (good, bad_tool, unlisted, bad_args)) + "\n")
    cfg = write_config(tmp_path, {"tokenizer": {"name": TOK_NAME}})
    p = run_stage("sft", "prepare", "--config", cfg, "--dataset", src)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "tools.jsonl:2: bad_messages (messages[1].role: a tool turn must answer a call" in p.stdout
    assert "tools.jsonl:3: call_of_unlisted_tool" in p.stdout
    assert "tools.jsonl:4: bad_messages (messages[2].tool_calls[0].function.arguments: is not valid JSON" in p.stdout
    ex = sft.load_examples(tmp_path / "data" / "post-training")
    assert len(ex) == 1
    tok = tokenizer()
    ids, mask = ex.example(0)
    text = tok.decode(list(map(int, ids)), skip_special_tokens=False)
    assert text.startswith("<s> User: Be brief.\n\nTools:\n{\"name\": \"get_weather\"")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call></s>' in text
    assert '<s> Tool: {"name": "get_weather", "content": "-3 C, snow"}\nAssistant: It is -3 C' in text
    assert _masked_text(tok, ids, mask) == ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                            '</tool_call></s> It is -3 C and snowing in Oslo.</s>')
    # what serve prompts with after the result is exactly the start of what was trained
    msgs = tools.read_messages(good["messages"][:4])
    prompt = chat.tool_prompt_ids(tok, sft.default_template(), msgs, tools.read_tools(good["tools"]))
    assert list(map(int, ids[:len(prompt)])) == prompt and mask[len(prompt)] == 1 and mask[len(prompt) - 1] == 0


def test_a_models_own_template_that_renders_tools_is_used_and_one_that_does_not_is_not():
    tok = _chat_tok()
    rec = tool_samples.records(1, seed=5)[0]
    while len(rec["messages"]) < 4:
        rec = tool_samples.conversation(__import__("random").Random(len(rec["messages"]) * 7 + 1))
    norm = sft.normalize_record(rec, "x", sft.Skips(), 10 ** 6)
    hermes = chat.jinja_record(tok, HERMES, "hermes-like")
    plain = chat.jinja_record(tok, PLAIN, "plain")
    assert chat.knows_tools(tok, hermes) and not chat.knows_tools(tok, plain)
    assert chat.knows_tools(tok, sft.default_template())
    (ids, mask), = chat.encode_records(tok, hermes, [norm], None, None)
    view = chat._chat_tokenizer(tok)
    assert ids == list(view.apply_chat_template([chat._for_template(m) for m in norm["messages"]],
                                                tools=tools.as_transformers_tools(norm["tools"]),
                                                chat_template=HERMES, tokenize=True, return_dict=False))
    trained = _masked_text(tok, ids, mask)
    assert trained.count("<|im_end|>") == 2 and "<tool_call>" in trained and "tool_response" not in trained
    assert '"content"' not in trained and "Tools:" not in trained
