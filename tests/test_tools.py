"""Tool use, from data to serving: `sft prepare` on the conversational tools shape (ours and a
model's own template that renders tools; the loss on calls and answers, never on results; the
generated sample set), and `serve` answering OpenAI's `tools` / `tool_choice` /
`parallel_tool_calls` (constrained calls that always validate, the openai client's tool loop
streamed and not, the chat page, what is still refused). Also serve's fixes found by reading
(a grammar compiled off the event loop within bounds, inter-token latency counted per choice)
and a short soak under mixed load (perf/soak_serve.py). The server is one per module: a tiny
model SFT'd on the generated set for a few steps."""
from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from tests.conftest import headless_chromium, needs_browser, run_stage, write_config
from tests.test_public_models import SMOL, smol, tiny_llama  # noqa: F401 (smol: a fixture)
from tests.test_serve import make_script_checkpoint
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
    # the call format serve reads back: ours, the Hermes one (calls back to back here), none
    assert chat.call_format(tok, sft.default_template()) == tools.OUR_CALLS
    assert chat.call_format(tok, hermes) == tools.CallFormat("<tool_call>\n", "\n</tool_call>", "")
    assert chat.call_format(tok, plain) is None
    (ids, mask), = chat.encode_records(tok, hermes, [norm], None, None)
    view = chat._chat_tokenizer(tok)
    assert ids == list(view.apply_chat_template([chat._for_template(m) for m in norm["messages"]],
                                                tools=tools.as_transformers_tools(norm["tools"]),
                                                chat_template=HERMES, tokenize=True, return_dict=False))
    trained = _masked_text(tok, ids, mask)
    assert trained.count("<|im_end|>") == 2 and "<tool_call>" in trained and "tool_response" not in trained
    assert '"content"' not in trained and "Tools:" not in trained


# --------------------------------------------------------------------------- serve
BOUNDED = [  # functions whose every valid call is short: a cut-off by max_tokens cannot happen
    {"type": "function", "function": {"name": "gcd", "description": "The greatest common divisor.",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["a", "b"],
                                                     "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 999},
                                                                    "b": {"type": "integer", "minimum": 1, "maximum": 999}}}}},
    {"type": "function", "function": {"name": "convert_length", "description": "A length in another unit.",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["value", "from_unit", "to_unit"],
                                                     "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                    "from_unit": {"enum": ["m", "km", "mi", "ft"]},
                                                                    "to_unit": {"enum": ["m", "km", "mi", "ft"]}}}}},
    {"type": "function", "function": {"name": "is_prime", "description": "Whether n is prime.",
                                      "parameters": {"type": "object", "additionalProperties": False, "required": ["n"],
                                                     "properties": {"n": {"type": "integer", "minimum": 2, "maximum": 999},
                                                                    "note": {"type": "string", "maxLength": 6}}}}},
]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}
QUESTION = [{"role": "user", "content": "What is the greatest common divisor of 84 and 36?"}]


CALLS_TEXT = "Ok <tool_call>"            # what the scripted caller writes; the grammar writes the rest
SAYS_TEXT = "Sure, a <b> tag."        # the scripted talker's reply: a "<" that opens no call


def make_scripted_chat(path, text: str, then_eos: bool):
    """A chat checkpoint (our template) whose greedy reply to any prompt is ``text``'s tokens,
    then EOS (``then_eos``) or logits all exactly 0 (tests/test_serve.py's script model, as a
    chat model). Where the grammar rules the script's token out, every allowed token has logit
    0 and greedy takes the lowest id: the reply is the same on every machine, whatever its
    floating point."""
    make_script_checkpoint(path, text, then_eos=then_eos, cycle=False, max_seq_len=1024,
                           chat_template=sft.default_template())
    return path


def _trl_template(name: str) -> str:
    """A public model's chat template as TRL ships it (byte-identical to the model's own, TRL's
    chat_templates/README.md): real templates, offline."""
    import importlib.resources
    return (importlib.resources.files("trl") / "chat_templates" / name).read_text(encoding="utf-8")


# public models' own templates, each on a tiny random Llama with SmolLM2's ChatML vocabulary
OWN_TEMPLATES = {"qwen2.5-template": "qwen2_5.jinja",        # renders tools, Hermes calls
                 "llama3.1-template": "llama3_1.jinja",      # renders tools, bare JSON calls
                 "smollm2-template": None}                   # SmolLM2's own: renders no tools


def _own_template(name: str) -> str:
    file = OWN_TEMPLATES[name]
    return _trl_template(file) if file else (SMOL / "chat_template.jinja").read_text(encoding="utf-8")


def _public_folder(root, name: str, source: str):
    """A Hugging Face folder (tests/test_public_models.py's tiny SmolLM2-vocabulary Llama) whose
    chat template is ``source``."""
    folder = tiny_llama(SMOL, root / name)
    (folder / "chat_template.jinja").write_text(source, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tools_run(tmp_path_factory, samples):
    """A tiny model SFT'd on the generated tool-use set (3 steps: it need not be smart, the
    constraint guarantees the shape): its root, config and run folder."""
    from tests.test_sft import make_checkpoint
    root = tmp_path_factory.mktemp("tool_serve")
    cfg = write_config(root, {"tokenizer": {"name": TOK_NAME}, "logging": {"tensorboard": False},
                              "serve": {"max_batch": 8}})
    base = make_checkpoint(root / "checkpoints" / "base" / "checkpoint_best.pt", max_seq_len=1024)
    p = run_stage("sft", "prepare", "--config", cfg, "--dataset", "tools", "--limit", "48")
    assert p.returncode == 0, p.stdout + p.stderr
    q = run_stage("sft", "train", "--config", cfg, "--checkpoint", base, "--name", "tools", "--max-steps", "3",
                  "--batch-size", "4", "--sample-tokens", "0", "--device", "cpu")
    assert q.returncode == 0, q.stdout + q.stderr
    run, = (root / "checkpoints").glob("sft_tools_*")
    return {"root": root, "cfg": cfg, "run": run}


@pytest.fixture(scope="module")
def tool_server(tools_run, smol):
    """The SFT'd tiny model served as a user serves it, beside two scripted chat models whose
    choice under "auto" is fixed (``caller`` opens a call, ``talker`` writes text): what the
    tiny model chooses under "auto" is its own, and may differ between machines."""
    from tests.test_serve import Server
    root = tools_run["root"]
    caller = make_scripted_chat(root / "checkpoints" / "caller" / "checkpoint_best.pt", CALLS_TEXT, False)
    talker = make_scripted_chat(root / "checkpoints" / "talker" / "checkpoint_best.pt", SAYS_TEXT, True)
    own = [_public_folder(root, name, _own_template(name)) for name in OWN_TEMPLATES]
    s = Server(root, tools_run["cfg"], "--checkpoint", tools_run["run"], "--checkpoint", caller,
               "--checkpoint", talker, *[a for f in own for a in ("--checkpoint", f)])
    s.model = s.client.models.list().data[0].id
    assert [m.id for m in s.client.models.list().data][1:] == ["caller", "talker", *OWN_TEMPLATES]
    yield s
    assert s.stop() == 130, s.stderr()


def _check_calls(message, names) -> list:
    """The calls of a reply, each validated against its function's schema."""
    assert message.tool_calls, message
    out = []
    for c in message.tool_calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names, c
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMA_OF[c.function.name])
        out.append((c.function.name, args))
    return out


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_calls_always_parse_and_validate_over_many_seeds(tool_server, choice):
    import concurrent.futures as cf
    tc = "required" if choice == "required" else {"type": "function", "function": {"name": "convert_length"}}
    names = {"convert_length"} if choice == "named" else set(SCHEMA_OF)

    def ask(seed):
        parallel = seed % 2 == 0
        r = tool_server.client.chat.completions.create(
            model=tool_server.model, messages=QUESTION, tools=BOUNDED, tool_choice=tc, parallel_tool_calls=parallel,
            temperature=1.0, seed=seed, max_tokens=160)
        c = r.choices[0]
        # one call: the grammar ends the reply with it; several allowed: each call is complete and valid,
        # and the model may go on calling until max_tokens cuts the reply (the cut call is not returned)
        assert c.finish_reason == "tool_calls" or (parallel and c.finish_reason == "length"), c
        calls = _check_calls(c.message, names)
        assert parallel or len(calls) == 1, calls
        return calls
    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(12)))
    assert len({json.dumps(r) for r in results}) > 4           # sampled: many different calls, all valid


def _stream(client, **kw):
    """A streamed reply assembled as the openai client's own helper assembles it (its snapshot:
    the helper's final parse refuses a reply cut by max_tokens)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


def _run(call) -> str:
    """The real function of a call, run on its arguments (what an application does)."""
    fn = tool_samples.FUNCTIONS[call.function.name][0]
    args = {k: v for k, v in json.loads(call.function.arguments).items() if k != "note"}
    return json.dumps(fn(**args))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_the_openai_tool_loop_calls_runs_the_function_and_answers(tool_server, stream):
    client = tool_server.client

    def create(**kw):
        kw = dict(model=tool_server.model, tools=BOUNDED, max_tokens=60, seed=7, temperature=0.8, **kw)
        return _stream(client, **kw) if stream else client.chat.completions.create(**kw)
    messages = list(QUESTION)
    r = create(messages=messages, tool_choice="required", parallel_tool_calls=False)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    (name, args), = _check_calls(msg, set(SCHEMA_OF))
    messages.append({"role": "assistant", "content": msg.content,
                     "tool_calls": [{"id": c.id, "type": "function",
                                     "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                    for c in msg.tool_calls]})
    messages += [{"role": "tool", "tool_call_id": c.id, "content": _run(c)} for c in msg.tool_calls]
    final = create(messages=messages, tool_choice="none")
    assert final.choices[0].finish_reason in ("stop", "length")
    answer = final.choices[0].message
    assert not answer.tool_calls and isinstance(answer.content, str) and tools.CALL_OPEN not in answer.content
    # the same request gives the same answer, streamed or not
    again = (client.chat.completions.create if stream else lambda **kw: _stream(client, **kw))(
        model=tool_server.model, tools=BOUNDED, max_tokens=60, seed=7, temperature=0.8, messages=messages,
        tool_choice="none")
    assert again.choices[0].message.content == answer.content


def test_auto_lets_the_model_choose_a_call_it_opens_validates_and_streamed_equals_plain(tool_server):
    """With "auto" the model chooses. The scripted caller writes "Ok " and opens a call, and the
    grammar writes the rest: a valid call, the reply ending "tool_calls"; the scripted talker writes text whose
    '<' opens no call (a stream holds it back, then lets it through): "stop". The SFT'd tiny
    model chooses as its weights (and the machine's floating point) say: whatever it chose, its
    greedy reply is the same streamed and not."""
    client = tool_server.client
    for q in ["What is the greatest common divisor of 84 and 36?", "Hello!"]:
        for model in ("caller", "talker", tool_server.model):
            kw = dict(model=model, tools=BOUNDED, tool_choice="auto", max_tokens=80, temperature=0,
                      messages=[{"role": "user", "content": q}])
            plain, streamed = client.chat.completions.create(**kw), _stream(client, **kw)
            for r in (plain, streamed):
                c = r.choices[0]
                if model == "caller":
                    (name, args), = _check_calls(c.message, set(SCHEMA_OF))   # parallel allowed, one made
                    # the text before the call, without the space before it: streamed (held back) as plain
                    assert c.finish_reason == "tool_calls" and c.message.content == "Ok", c
                elif model == "talker":
                    assert (c.finish_reason, c.message.content, c.message.tool_calls) == ("stop", SAYS_TEXT, None), c
            # (a stream's first delta carries content "", as OpenAI's do: its snapshot has "" for null)
            assert (plain.choices[0].message.content or "") == (streamed.choices[0].message.content or "")
            assert plain.choices[0].finish_reason == streamed.choices[0].finish_reason
            assert [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls or []] == \
                   [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls or []]


def test_what_is_still_refused_about_tools_is_named(tool_server):
    import httpx2 as httpx
    url = tool_server.url + "/v1/chat/completions"
    base = {"model": tool_server.model, "messages": QUESTION, "max_tokens": 4}
    cases = [
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", "unsupported_parameter"),
        ({"tools": BOUNDED, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "invalid_value"),
        ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
        ({"tools": BOUNDED, "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        ({"tools": BOUNDED, "response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
        ({"tools": BOUNDED, "logprobs": True}, "logprobs", "unsupported_parameter"),
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "invalid_value"),
        ({"messages": QUESTION + [{"role": "tool", "content": "1"}]}, "messages[1].role", "invalid_value"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            f"p{i}": {"type": "string", "description": "x" * 100} for i in range(700)}}}}]}, "tools", "schema_too_large"),
    ]
    for extra, param, code in cases:
        r = httpx.post(url, json={**base, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (param, code), (extra, err)


def test_a_public_models_own_template_serves_tools_when_its_call_format_is_read_else_says_why(tool_server, tools_run):
    """A model that chats by its own template: Qwen2.5's (Hermes ``<tool_call>`` JSON) is served
    tools through that template, its calls constrained in its own format (streamed and not, a
    call, the result, the answer; the prompt is transformers' `apply_chat_template(tools=...)`
    of it); Llama 3.1's renders tools but writes bare JSON calls, SmolLM2's renders no tools:
    each a 400 that says which and what to do."""
    import httpx2 as httpx
    from transformers import AutoTokenizer
    client, model = tool_server.client, "qwen2.5-template"
    messages = list(QUESTION)
    kw = dict(model=model, tools=BOUNDED, max_tokens=60, temperature=0.8, seed=3)
    r = client.chat.completions.create(messages=messages, tool_choice="required", parallel_tool_calls=False, **kw)
    streamed = _stream(client, messages=messages, tool_choice="required", parallel_tool_calls=False, **kw)
    for reply in (r, streamed):
        assert reply.choices[0].finish_reason == "tool_calls" and not (reply.choices[0].message.content or "")
    (name, args), = _check_calls(r.choices[0].message, set(SCHEMA_OF))
    assert _check_calls(streamed.choices[0].message, set(SCHEMA_OF)) == [(name, args)]
    ht = AutoTokenizer.from_pretrained(tools_run["root"] / model, local_files_only=True)
    assert ht.chat_template == _own_template(model)
    assert r.usage.prompt_tokens == len(ht.apply_chat_template(messages, tools=BOUNDED, add_generation_prompt=True,
                                                               tokenize=True, return_dict=False))
    call = r.choices[0].message.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call.id, "type": "function", "function": {"name": name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": _run(call)}]
    final = client.chat.completions.create(messages=messages, tool_choice="none", **kw)
    assert final.choices[0].finish_reason in ("stop", "length") and not final.choices[0].message.tool_calls
    assert tools.CALL_OPEN not in (final.choices[0].message.content or "")
    rendered = copy.deepcopy(messages)                          # transformers' templates take dict arguments
    rendered[1]["tool_calls"][0]["function"]["arguments"] = args
    assert final.usage.prompt_tokens == len(ht.apply_chat_template(rendered, tools=BOUNDED, add_generation_prompt=True,
                                                                   tokenize=True, return_dict=False))
    named = client.chat.completions.create(messages=QUESTION, tool_choice={"type": "function", "function": {
        "name": "is_prime"}}, **kw)
    assert [n for n, _ in _check_calls(named.choices[0].message, {"is_prime"})] and \
        named.choices[0].finish_reason in ("tool_calls", "length")
    for other, why in (("llama3.1-template", "renders tools but writes its calls in a format this server does not read"),
                       ("smollm2-template", "which does not render tools")):
        resp = httpx.post(tool_server.url + "/v1/chat/completions", timeout=60, json={
            "model": other, "messages": QUESTION, "tools": BOUNDED, "max_tokens": 4})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert (err["param"], err["code"]) == ("tools", "unsupported_parameter") and why in err["message"], err
        assert "sft prepare --dataset tools" in err["message"], err
        plain = client.chat.completions.create(model=other, messages=QUESTION, max_tokens=2)   # without tools: served
        assert plain.choices[0].finish_reason in ("stop", "length")


# --------------------------------------------------------------------------- export
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now, in °C.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}},
           {"type": "function", "function": {"name": "local_time"}}]      # no description, no parameters
EXPORT_CHATS = {
    "no tools": (None, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": "Rayleigh scattering."},
        {"role": "user", "content": "And at sunset?"},
        {"role": "assistant", "content": "Longer path, more red."}]),
    "a call, its result, the answer": (WEATHER, [
        {"role": "system", "content": "Answer with the tools."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 °C, snow"},
        {"role": "assistant", "content": "It is -3 °C and snowing in Zürich."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."}]),
    "parallel calls, results out of order": (WEATHER, [
        {"role": "user", "content": "Weather in Oslo, and the time?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [     # OpenAI's arguments: JSON text
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "b", "type": "function", "function": {"name": "local_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "b", "content": "14:05"},
        {"role": "tool", "tool_call_id": "a", "content": "2 °C, rain"},
        {"role": "assistant", "content": "2 °C and raining in Oslo; it is 14:05."}]),
}


def test_an_export_renders_tools_calls_and_results_as_training_and_serve_do(tools_run):
    """`export` of the SFT'd run (a Hugging Face folder and a GGUF): transformers'
    `apply_chat_template(messages, tools=...)` on the exported folder gives exactly the text and
    the ids `sft prepare` trained on, and with add_generation_prompt the prompt `serve` sends
    after each user or tool turn (no tools; a call, its result and the answer; parallel calls
    answered out of order); the GGUF carries the same template; a tool turn answering no call
    is refused as `sft prepare` and `serve` refuse it."""
    import gguf
    from transformers import AutoTokenizer
    from utils.run import load_checkpoint
    hf, gg = tools_run["root"] / "exports" / "hf", tools_run["root"] / "exports" / "gguf"
    for fmt, out in (("hf", hf), ("gguf", gg)):
        p = run_stage("export", "--config", tools_run["cfg"], "--checkpoint", tools_run["run"], "--format", fmt,
                      "--out", out, *(["--dtype", "f32"] if fmt == "gguf" else []))
        assert p.returncode == 0, p.stdout + p.stderr
    ht = AutoTokenizer.from_pretrained(hf, local_files_only=True)
    tok, template = tokenizer(), load_checkpoint(next(tools_run["run"].glob("checkpoint_*.pt")))["chat_template"]
    assert template["name"] == sft.TEMPLATE_V2
    bos, eos = tok.bos_token_id, tok.eos_token_id
    for what, (fns, messages) in EXPORT_CHATS.items():
        functions = tools.read_tools(fns or [])
        norm = tools.read_messages(messages)
        # ours: each exchange one text between BOS and EOS (utils/data/tools.py, utils/data/sft.py)
        text = "".join(tok.bos_token + sft.opening_prompt(template, e.opening, e.tool)
                       + ("" if e.answer is None else sft.answer_lead(template) + e.answer + tok.eos_token)
                       for e in tools.exchanges(norm, functions))
        record = sft.normalize_record({"messages": messages, **({"tools": fns} if fns else {})}, what, sft.Skips(), 10 ** 6)
        (trained, _), = chat.encode_records(tok, template, [record], bos, eos)
        assert ht.apply_chat_template(messages, tools=fns, tokenize=False) == text, what
        assert ht.apply_chat_template(messages, tools=fns, tokenize=True, return_dict=False) == trained, what
        for k in [k for k, m in enumerate(messages) if m["role"] in ("user", "tool")
                  and (k + 1 == len(messages) or messages[k + 1]["role"] != "tool")]:
            served = (chat.tool_prompt_ids(tok, template, tools.read_messages(messages[:k + 1]), functions) if fns else
                      chat.chat_prompt_ids(tok, template, messages[0]["content"] if messages[0]["role"] == "system" else "",
                                           [(a["content"], b["content"]) for a, b in zip(messages[1:k:2], messages[2:k:2])],
                                           messages[k]["content"]))
            assert ht.apply_chat_template(messages[:k + 1], tools=fns, add_generation_prompt=True, tokenize=True,
                                          return_dict=False) == served, (what, k)
    shown = ht.apply_chat_template(EXPORT_CHATS["a call, its result, the answer"][1][:4], tools=WEATHER, tokenize=False,
                                   add_generation_prompt=True)
    assert shown == ('<s>User: Answer with the tools.\n\nTools:\n'
                     '{"name": "get_weather", "description": "Weather now, in °C.", "parameters": {"type": "object", '
                     '"properties": {"city": {"type": "string"}}, "required": ["city"]}}\n'
                     '{"name": "local_time", "description": "", "parameters": {"type": "object", "properties": {}}}'
                     '\n\nWeather in Zürich?\nAssistant: <tool_call>{"name": "get_weather", "arguments": '
                     '{"city": "Zürich"}}</tool_call></s><s>Tool: {"name": "get_weather", "content": "-3 °C, snow"}'
                     '\nAssistant:')
    with pytest.raises(Exception, match="one tool turn per call"):
        ht.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "tool", "content": "1"}], tokenize=False)
    conf = json.loads((hf / "tokenizer_config.json").read_text(encoding="utf-8"))
    reader = gguf.GGUFReader(str(next(gg.glob("*.gguf"))))
    field = reader.fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode("utf-8") == conf["chat_template"] == ht.chat_template


# --------------------------------------------------------------------------- fixes found by reading
def test_a_grammar_compiles_off_the_event_loop_within_its_size_and_time_bounds(monkeypatch):
    """A schema is compiled in a worker thread: the loop goes on serving while it compiles;
    one over MAX_SCHEMA_BYTES is refused before compiling, and one compiling past COMPILE_SECONDS
    is a 400."""
    import asyncio
    import time
    from utils.serve import intake, protocol

    def slow(constraint, lead="", calls=None):
        time.sleep(1.0)
        return protocol.build_grammar(constraint, lead, calls)
    s = protocol.read_common({"response_format": {"type": "json_object"}}, protocol.Limits(), chat=True)

    async def run():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        t = asyncio.create_task(ticker())
        grammar = await intake.compile_grammar(s)
        t.cancel()
        return grammar, ticks
    monkeypatch.setattr(intake, "build_grammar", slow)
    grammar, ticks = asyncio.run(run())
    assert grammar and ticks >= 10                # the loop ran on through the compile's 1 s (blocked: 0)
    monkeypatch.setattr(intake, "COMPILE_SECONDS", 0.1)
    with pytest.raises(protocol.ApiError) as e:
        asyncio.run(intake.compile_grammar(s))
    assert (e.value.status, e.value.code, e.value.param) == (400, "schema_too_complex", "response_format.json_schema.schema")
    monkeypatch.undo()
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(700)}}
    s.constraint = ("json", big)
    with pytest.raises(protocol.ApiError) as e:
        asyncio.run(intake.compile_grammar(s))
    assert e.value.code == "schema_too_large" and "65,536" in e.value.message


def test_inter_token_latency_is_one_weighted_observation_per_choice_not_one_per_token():
    """A choice of 10 million tokens is counted in one step (the library's Histogram took one
    call per token, on the event loop), and the exposition is what those observations give."""
    import time
    from types import SimpleNamespace
    from prometheus_client.parser import text_string_to_metric_families
    from utils.serve.metrics import ServeMetrics
    m = ServeMetrics({})
    seq = SimpleNamespace(tokens=range(10_000_001), cancelled=False)
    job = SimpleNamespace(m=SimpleNamespace(id="x"), t0=time.perf_counter() - 50.0, seqs=[seq], finish=["length"],
                          prompt_tokens=3, ttft=0.5)
    t0 = time.perf_counter()
    m.request_ended(job)
    assert time.perf_counter() - t0 < 0.5
    got = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(m.render()[0].decode())
           for s in f.samples if s.name.startswith("llm_inter_token_latency_seconds")}
    assert got[("llm_inter_token_latency_seconds_count", None)] == 10_000_000
    assert got[("llm_inter_token_latency_seconds_bucket", "0.01")] == 10_000_000     # each gap ~5 microseconds
    assert got[("llm_inter_token_latency_seconds_sum", None)] == pytest.approx(49.5, rel=1e-3)


@needs_browser
def test_the_chat_page_shows_a_call_and_its_result_then_the_answer(tool_server, tmp_path):
    """Headless Chromium: tools pasted, tool choice "required", parallel calls off: the model's
    one call is shown (name and arguments that validate) and the reply ends "tool_calls" (with
    parallel calls on, a tiny model may go on calling until max tokens cut it: "length"); the
    result typed goes back as a tool turn, the model answers."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait
    driver = headless_chromium(tmp_path / "profile", "1100,800")
    wait = WebDriverWait(driver, 60, poll_frequency=0.1)
    try:
        driver.get(tool_server.url + "/")
        wait.until(lambda d: len(Select(d.find_element(By.ID, "model")).options) == 3 + len(OWN_TEMPLATES))
        assert Select(driver.find_element(By.ID, "model")).first_selected_option.get_attribute("value") == \
            tool_server.model
        driver.find_element(By.CSS_SELECTOR, "#tools-box summary").click()
        driver.execute_script("document.getElementById('tools').value = arguments[0];", json.dumps(BOUNDED[:1]))
        Select(driver.find_element(By.ID, "tool-choice")).select_by_value("required")
        parallel = driver.find_element(By.ID, "parallel-calls")
        assert parallel.is_selected()                                   # OpenAI's default: on
        parallel.click()
        driver.find_element(By.ID, "input").send_keys(QUESTION[0]["content"])
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta"))
        call, = [c.text for c in driver.find_elements(By.CSS_SELECTOR, ".msg.call")]
        assert call.startswith("gcd(") and call.endswith(")")
        jsonschema.validate(json.loads(call[4:-1]), SCHEMA_OF["gcd"])
        assert "finish: tool_calls" in driver.find_element(By.CSS_SELECTOR, ".msg.assistant .meta").text
        Select(driver.find_element(By.ID, "tool-choice")).select_by_value("none")
        driver.find_element(By.ID, "input").send_keys("12")
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")) == 2)
        assert [t.text for t in driver.find_elements(By.CSS_SELECTOR, ".msg.tool")] == ["gcd \u2192 12"]
        assert not driver.find_elements(By.CSS_SELECTOR, ".msg.error")
        line = [x for x in tool_server.stderr().splitlines() if "prompt_tokens=" in x][-1]
        assert "finish=stop" in line or "finish=length" in line
        driver.save_screenshot(str(tmp_path / "tools.png"))
    finally:
        driver.quit()


def test_a_short_soak_under_mixed_load_has_no_5xx_and_leaks_no_files(tool_server):
    """perf/soak_serve.py's load (chat, streams, completions, JSON schema, tool calls, cancelled
    and dropped streams, bad requests) for 12 s in 3 windows against this module's server: no
    5xx, nothing unexpected, every kind sent, open files and memory flat."""
    from perf.soak_serve import KINDS, children, soak
    out = soak(tool_server.url, children(tool_server.proc.pid), tool_server.model, seconds=12, window=4,
               streams=3, seed=1, say=lambda line: None)
    s, windows = out["summary"], out["windows"]
    assert s["server_errors"] == 0 and s["unexpected"] == 0, windows
    assert all(sum(w["requests"][k] for w in windows) > 0 for k in KINDS), windows
    assert windows[-1]["open_files"] <= windows[0]["open_files"] + 2, s["open_files"]
    assert s["rss_growth"] < 0.2, windows
