"""Several LoRA adapters on one base (utils/generation/adapters.py; docs/serve.md, Adapters):
rows of different adapters and base rows in one continuous batch each give what that adapter
gives alone (and what the adapter merged into the weights gives), on both paths of a decode
step (the CPU decode pack and the Linear layers); the prefix cache keeps adapters apart; a
live `main.py serve --adapter` (127.0.0.1, a free port) answers mixed concurrent requests as
it answers each alone, lists its adapters, loads and unloads them at runtime behind the API
key (ours and vLLM's endpoints) and refuses bad ones with OpenAI-shaped errors; a bad
``--adapter`` stops the start with exit 2 naming the file."""
from __future__ import annotations

import concurrent.futures as cf
import json
import pickle
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import run_stage, write_config
from tests.test_serve import Server
from tests.test_sft import TOK_NAME, make_checkpoint

KEY = "adapter-test-key"
PROMPT = [1, 45, 67, 89, 120, 33, 250, 17, 99, 180, 11, 42, 43, 44, 45, 46, 47, 48, 49]   # 19 tokens: a full block


def adapter_entry(shapes: dict, seed: int, rank: int, targets: list[str], alpha: float | None = None) -> dict:
    """A LoRA entry (utils/lora.py) with random A and B large enough to change the tiny model's
    greedy tokens."""
    from utils import lora
    g = torch.Generator().manual_seed(seed)
    w = {}
    n_layers = len({k.split(".")[1] for k in shapes if k.startswith("layers.")})
    for i in range(n_layers):
        for t in targets:
            out_f, in_f = shapes[f"layers.{i}.{lora.TARGETS[t]}.weight"]
            w[f"layers.{i}.{lora.TARGETS[t]}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.3
            w[f"layers.{i}.{lora.TARGETS[t]}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.3
    return {"rank": rank, "alpha": alpha or 2.0 * rank, "dropout": 0.0, "target_modules": targets,
            "rslora": False, "weights": w}


def write_peft(folder: Path, entry: dict, **config) -> Path:
    """``entry`` as a PEFT LoRA folder (what peft's save_pretrained writes; without importing peft)."""
    from utils.hf.adapter import peft_key
    folder.mkdir(parents=True)
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": entry["rank"], "lora_alpha": entry["alpha"],
           "lora_dropout": 0.0, "target_modules": entry["target_modules"], "bias": "none", "use_rslora": False,
           **config}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({peft_key(k): v.contiguous() for k, v in entry["weights"].items()},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def work(tmp_path_factory, samples):
    from utils.data import sft
    from utils.training.checkpoint import save_checkpoint
    root = tmp_path_factory.mktemp("adapters")
    cfg = write_config(root, {"tokenizer": {"name": TOK_NAME}, "serve": {"max_batch": 8}})
    base = make_checkpoint(root / "checkpoints" / "base" / "checkpoint_best.pt", kind="sft", seed=5,
                           chat_template=sft.default_template())
    ckpt = torch.load(base, weights_only=True)
    shapes = {k: tuple(v.shape) for k, v in ckpt["model"].items()}
    entries = {"a": adapter_entry(shapes, 1, 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"]),
               "b": adapter_entry(shapes, 2, 2, ["q_proj", "v_proj", "down_proj"]),
               "c": adapter_entry(shapes, 3, 8, ["o_proj", "gate_proj", "up_proj"]),
               "d": adapter_entry(shapes, 4, 4, ["k_proj", "up_proj"])}
    dirs = {k: write_peft(root / "adapters" / k, entries[k]) for k in ("a", "b", "d")}
    run_c = root / "checkpoints" / "sft_lora_c"                  # c: a LoRA run's checkpoint (base + entry)
    save_checkpoint(run_c / "checkpoint_best.pt", {**ckpt, "lora": entries["c"]})
    dirs["c"] = run_c
    small = make_checkpoint(root / "other" / "checkpoint_best.pt", d_model=32, n_heads=2, n_kv_heads=1)
    other = torch.load(small, weights_only=True)
    dirs["wrong_shapes"] = write_peft(root / "adapters" / "wrong", adapter_entry(
        {k: tuple(v.shape) for k, v in other["model"].items()}, 5, 2, ["q_proj"]))
    return {"root": root, "cfg": cfg, "base": base, "entries": entries, "dirs": dirs}


# --------------------------------------------------------------------------- the engine
def _engine(work, prefix_cache_mb: int = 0, **kw):
    from utils.generation.engine import Engine
    from utils.run import load_model
    model = load_model(work["base"])[0]
    engine = Engine(model, product="torch", **kw)
    for name in "abc":
        engine.adapters.load(name, work["entries"][name])
    engine.use_prefix_cache(prefix_cache_mb << 20)
    return engine


def _run(engine, rows: list[tuple], n: int = 12) -> list[list[int]]:
    """New tokens of each row (prompt, adapter, seed: None greedy) run together in one batcher."""
    from utils.generation.engine import Sequence, SamplingParams
    b = engine.batcher(8, 128)
    seqs = [b.add(Sequence(p, SamplingParams(n, 0.0 if seed is None else 0.9, seed=seed, adapter=a), tag=r))
            for r, (p, a, seed) in enumerate(rows)]
    out = [[] for _ in rows]
    for events in engine.run(b):
        for e in events:
            if e.token is not None:
                out[e.seq.tag].append(e.token)
    return out, seqs


ROWS = [(PROMPT, None, None), (PROMPT, "a", None), (PROMPT[:9], "b", 11), (PROMPT, "c", None),
        (PROMPT[3:], "a", 12), (PROMPT[:7], None, 13), (PROMPT, "b", None), (PROMPT[2:], "c", 14)]


@pytest.mark.parametrize("path", ["pack", "linear"])
def test_a_mixed_batch_equals_each_adapter_alone_and_merged(work, path):
    """8 rows (base, a, b, c; greedy and seeded) in one batch: each row's tokens equal its lone
    run, and a greedy adapter row's equal the adapter merged into the weights; adapters change
    the tokens (the check can fail). "pack": fp32 on CPU (the decode pack's products);
    "linear": bf16 autocast (the Linear layers' forward hooks)."""
    import model as model_lib
    from utils import lora
    from utils.generation.engine import Engine
    engine = _engine(work, amp=torch.bfloat16 if path == "linear" else None)
    assert (engine.decode_pack() is not None) == (path == "pack")
    mixed, _ = _run(engine, ROWS)
    alone = [_run(engine, [row])[0][0] for row in ROWS]
    assert mixed == alone
    assert len({tuple(t) for t in (mixed[0], mixed[1], mixed[3], mixed[6])}) == 4    # base, a, c, b differ
    if path == "pack":
        ckpt = torch.load(work["base"], weights_only=True)
        for r, (p, name, seed) in enumerate(ROWS):
            if name is None or seed is not None:
                continue
            merged = model_lib.create_model(ckpt["model_args"])
            merged.load_state_dict(lora.merged(ckpt["model"], work["entries"][name]))
            assert Engine(merged, product="torch").generate([p], 12, temperature=0.0)[0] == mixed[r], name


def test_the_prefix_cache_never_gives_one_adapter_the_base_or_another_adapter_kv(work):
    engine = _engine(work, prefix_cache_mb=4)
    plain = _engine(work)                                     # no prefix cache
    (base,), (s0,) = _run(engine, [(PROMPT, None, None)])
    (with_a,), (s1,) = _run(engine, [(PROMPT, "a", None)])
    (with_b,), (s2,) = _run(engine, [(PROMPT, "b", None)])
    (again_a,), (s3,) = _run(engine, [(PROMPT, "a", None)])
    assert (s0.cached, s1.cached, s2.cached, s3.cached) == (0, 0, 0, 16)   # a's second run reuses a's block
    assert [base, with_a, with_b] == [_run(plain, [(PROMPT, x, None)])[0][0] for x in (None, "a", "b")]
    assert again_a == with_a and len({tuple(base), tuple(with_a), tuple(with_b)}) == 3
    engine.adapters.unload("a")                               # reloaded under the same name: other weights
    engine.adapters.load("a", work["entries"]["b"])
    (reloaded,), (s4,) = _run(engine, [(PROMPT, "a", None)])
    assert s4.cached == 0 and reloaded == with_b


def test_an_adapter_unloaded_mid_generation_finishes_its_rows_with_it(work):
    from utils.generation.engine import Sequence, SamplingParams
    engine = _engine(work)
    want = _run(engine, [(PROMPT, "a", None), (PROMPT, "b", None)])[0]
    b = engine.batcher(8, 128)
    seqs = [b.add(Sequence(PROMPT, SamplingParams(12, 0.0, adapter=x))) for x in ("a", "b")]
    b.step()
    b.step()
    engine.adapters.unload("a")                              # rows of a are running
    with pytest.raises(ValueError, match="no adapter named 'a'"):
        b.add(Sequence(PROMPT, SamplingParams(4, 0.0, adapter="a")))
    while b.has_work():
        b.step()
    assert [s.tokens for s in seqs] == want


def test_the_engine_refuses_bad_adapters_naming_what_is_wrong(work):
    engine = _engine(work)
    bad = dict(work["entries"]["a"])
    with pytest.raises(ValueError, match="already loaded"):
        engine.adapters.load("a", bad)
    w = dict(bad["weights"])
    w["layers.0.attn.wq.lora_A.weight"] = torch.zeros(4, 32)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq\.lora_A\.weight has shape \(4, 32\)"):
        engine.adapters.load("e", {**bad, "weights": w})
    with pytest.raises(ValueError, match="no adapter named 'zz'"):
        _run(engine, [(PROMPT, "zz", None)])


# --------------------------------------------------------------------------- the server
class _Exploit:
    """Unpickled, it would create ``marker``: what a weights_only load must never run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _completion(client, model: str, seed):
    r = client.completions.create(model=model, prompt="The cat sat on the", max_tokens=10, seed=seed,
                                  temperature=0.0 if seed is None else 0.9)
    return r.model, r.choices[0].text


def test_serve_mixed_adapters_runtime_load_unload_and_errors(work):
    d = work["dirs"]
    s = Server(work["root"], work["cfg"], "--checkpoint", work["base"].parent, "--api-key", KEY,
               "--adapter", f"a={d['a']}", "--adapter", f"base:c={d['c']}")
    auth = {"Authorization": f"Bearer {KEY}"}
    client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    post = lambda path, body, h=auth: httpx.post(s.url + path, json=body, headers=h, timeout=60)  # noqa: E731
    try:
        assert "adapter 'base:a'" in s.stderr() and "adapter 'base:c'" in s.stderr()
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {"base", "base:a", "base:c"}
        assert listed["base:c"].model_extra["parent"] == "base"
        assert listed["base:c"].model_extra["adapter"]["rank"] == 8

        jobs = [(m, seed) for m in ("base", "base:a", "base:c", "a") for seed in (None, 7)]
        alone = [_completion(client, m, seed) for m, seed in jobs]
        with cf.ThreadPoolExecutor(len(jobs)) as pool:          # all in one batch
            together = list(pool.map(lambda j: _completion(client, *j), jobs))
        assert together == alone
        assert [m for m, _ in alone] == ["base", "base", "base:a", "base:a", "base:c", "base:c", "base:a", "base:a"]
        assert len({alone[0][1], alone[2][1], alone[4][1]}) == 3   # the adapters change the text
        chat = dict(model="base:c", messages=[{"role": "user", "content": "Hello there"}], max_tokens=8, seed=3)
        whole = client.chat.completions.create(**chat)
        chunks = list(client.chat.completions.create(**chat, stream=True))
        assert whole.model == "base:c" and {c.model for c in chunks} == {"base:c"}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content

        # runtime: ours, then vLLM's endpoints
        assert post("/v1/adapters", {"name": "d", "path": str(d["d"])}, {}).status_code == 401
        r = post("/v1/adapters", {"name": "d", "path": str(d["d"])})
        assert r.status_code == 200 and r.json()["id"] == "base:d", r.text
        got_d = _completion(client, "base:d", None)
        assert got_d[0] == "base:d" and got_d[1] not in (alone[0][1], alone[2][1], alone[4][1])
        r = post("/v1/adapters", {"name": "d", "path": str(d["b"])})
        assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_exists"
        r = httpx.delete(s.url + "/v1/adapters/base:d", headers=auth, timeout=60)
        assert r.json() == {"id": "base:d", "object": "model", "deleted": True}
        with pytest.raises(openai.NotFoundError):
            _completion(client, "base:d", None)
        assert post("/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(d["d"])}).status_code == 200
        assert _completion(client, "d", None) == got_d              # the same file, the same tokens
        assert post("/v1/unload_lora_adapter", {"lora_name": "d"}).status_code == 200
        assert {m.id for m in client.models.list().data} == {"base", "base:a", "base:c"}

        # bad adapters: OpenAI-shaped 4xx naming the file or field
        broken = d["wrong_shapes"].parent / "broken"
        broken.mkdir()
        (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
        (broken / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
        pickled = d["wrong_shapes"].parent / "pickled"
        pickled.mkdir()
        (pickled / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
        (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not read")
        evil = work["root"] / "evil" / "checkpoint_best.pt"     # a pickle that would run a command
        evil.parent.mkdir()
        evil.write_bytes(pickle.dumps(_Exploit(work["root"] / "pwned")))
        for body, status, param, says in [
                ({"name": "w", "path": str(evil.parent)}, 400, "path", str(evil)),
                ({"name": "w", "path": str(d["wrong_shapes"])}, 400, "path", "has shape"),
                ({"name": "w", "path": str(broken)}, 400, "path", "cannot be read as safetensors"),
                ({"name": "w", "path": str(pickled)}, 400, "path", "adapter_model.bin, a pickle, is not read"),
                ({"name": "w", "path": str(work["base"])}, 400, "path", "holds no LoRA adapter"),
                ({"name": "w", "path": str(work["root"] / "nothing")}, 400, "path", "does not exist"),
                ({"name": "a:b", "path": str(d["b"])}, 400, "name", "not 1-64 letters"),
                ({"name": "w"}, 400, "path", "non-empty string"),
                ({"name": "w", "path": str(d["b"]), "model": "nope"}, 404, "model", "does not exist")]:
            r = post("/v1/adapters", body)
            err = r.json()["error"]
            assert (r.status_code, err["param"]) == (status, param) and says in err["message"], (body, r.text)
        r = httpx.delete(s.url + "/v1/adapters/zz", headers=auth, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
        assert not (work["root"] / "pwned").exists()
        assert _completion(client, "base:a", None) == alone[2]       # still serving as before
    finally:
        assert s.stop() == 130, s.stderr()


class _Lane:
    """A model's lane as serve's load_adapters uses it: ``call(fn, *args)`` runs ``fn(engine, *args)``
    (here in this process; serve: on the engine process's engine thread)."""

    def __init__(self, engine):
        self.engine = engine

    def call(self, fn, *args):
        return fn(self.engine, *args)


def test_a_bad_adapter_flag_stops_the_start_with_exit_2_naming_it(work):
    """Flags refused before anything loads (through main: exit 2), and an adapter that does not
    fit the opened base (serve.load_adapters, what main runs once the models are open: a
    UsageError, exit 2, naming the flag, the file and the tensor)."""
    import serve
    from utils.cli import UsageError
    from utils.serve.served import ServedModel
    d = work["dirs"]
    for spec, says in ((f"a={d['b']}", "given twice"), ("a", "give NAME=PATH"), (f"x:a={d['b']}", "no served model"),
                       (f"a b={d['b']}", "is not 1-64 letters"), ("e=/no/such/dir", "does not exist")):
        p = run_stage("serve", "--config", work["cfg"], "--checkpoint", work["base"], "--port", "0",
                      "--adapter", f"a={d['a']}", "--adapter", spec)
        assert p.returncode == 2 and says in p.stderr, (spec, p.stderr)
    m = ServedModel("base", None, "sft", None, _Lane(_engine(work)), 0)
    specs = serve.adapter_specs([f"e={d['c']}", f"w={d['wrong_shapes']}"], ["base"])
    with pytest.raises(UsageError, match=rf"--adapter w={d['wrong_shapes']}: .*has shape"):
        serve.load_adapters(specs, {"base": m})
    assert list(m.adapters) == ["e"] and m.adapters["e"]["rank"] == 8      # the run checkpoint's, loaded


def test_runtime_changes_are_locked_on_a_server_without_a_key_beyond_loopback():
    """serve passes runtime=False there (serve.py: no API key and a host that is not loopback)."""
    import asyncio
    import serve
    from utils.serve.adapters import AdapterAdmin
    from utils.serve.protocol import ApiError
    admin = AdapterAdmin({}, print, runtime=False)
    for call in (lambda: admin.load("x", "/tmp", None), lambda: admin.unload("x")):
        with pytest.raises(ApiError) as e:
            asyncio.run(call())
        assert (e.value.status, e.value.code) == (403, "adapters_locked")
    assert not serve.is_loopback("0.0.0.0") and serve.is_loopback("127.0.0.1")
