"""model.py: Hugging Face Llama parity both ways, RoPE/GQA, document masks, fused loss,
KV-cache and batched generation, sampling filters, seeds, presets and config errors."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import model as M
from model import ModelArgs, create_model, model_args_from_config
from utils.hf.mapping import from_hf_state_dict, hf_config, model_args_from_hf_config, to_hf_state_dict
from tests.conftest import run_stage
from utils.activations import GatedMLP
from utils.generation.engine import Engine
from utils.config import ConfigError, Config, MODEL_PRESETS, llama_ffn_hidden, load_config

V = 97
# the `cuda` marker (pytest.ini): `pytest -m cuda` selects the test, and tests/conftest.py skips it
# where torch.cuda.is_available() is False; other files import it (tests/test_compiled.py)
cuda = pytest.mark.cuda


def tiny(**kw) -> ModelArgs:
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                rope_theta=500.0, bos_id=1)
    base.update(kw)
    return ModelArgs(**base)


def build(seed=0, **kw):
    torch.manual_seed(seed)
    return create_model(tiny(**kw)).eval()


# --------------------------------------------------------------------------- Hugging Face parity
@pytest.mark.parametrize("n_kv_heads,tie,act", [(4, False, "swiglu"), (2, True, "swiglu"),
                                                (1, False, "swiglu"), (2, False, "geglu"),
                                                (4, True, "reglu")])
def test_hf_parity_both_ways(n_kv_heads, tie, act):
    from transformers import LlamaForCausalLM
    args = tiny(n_kv_heads=n_kv_heads, tie_embeddings=tie, activation=act)
    torch.manual_seed(0)
    ours = create_model(args).eval()
    x = torch.randint(0, V, (3, 24))
    # ours -> HF
    hf = LlamaForCausalLM(hf_config(args)).eval()
    hf.load_state_dict(to_hf_state_dict(ours), strict=True)
    with torch.no_grad():
        a, loss_a = ours(x[:, :-1], x[:, 1:])
        out = hf(x[:, :-1])
        hf_loss = hf(x, labels=x).loss
    torch.testing.assert_close(a, out.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss_a, hf_loss, atol=1e-5, rtol=0)
    # HF (fresh random weights) -> ours
    torch.manual_seed(1)
    hf2 = LlamaForCausalLM(hf_config(args)).eval()
    ours2 = create_model(args).eval()
    ours2.load_state_dict(from_hf_state_dict(hf2.state_dict(), args), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(ours2(x)[0], hf2(x).logits, atol=1e-5, rtol=0)
    assert ours.num_params() == hf.num_parameters()
    assert (ours.lm_head.weight is ours.tok_embeddings.weight) == tie


def test_hf_mapping_is_a_pure_rename_and_refuses_what_llama_lacks():
    m = build()
    sd = to_hf_state_dict(m)
    ours = m.state_dict()
    # tensors are shared, not copied
    assert sd["model.layers.1.self_attn.k_proj.weight"].data_ptr() == ours["layers.1.attn.wk.weight"].data_ptr()
    back = from_hf_state_dict(sd, m.args)
    assert set(back) == set(ours) and back["norm.weight"] is sd["model.norm.weight"]
    assert all(torch.equal(back[k], ours[k]) for k in ours)
    # compiled / DDP prefixes are stripped
    pref = {"_orig_mod." + k: v for k, v in ours.items()}
    assert set(to_hf_state_dict(pref, m.args)) == set(sd)
    with pytest.raises(ValueError, match="LayerNorm"):
        hf_config(tiny(norm="layernorm"))
    with pytest.raises(KeyError, match="lm_head"):
        d = dict(sd)
        del d["lm_head.weight"]
        from_hf_state_dict(d, tiny(tie_embeddings=False))
    args = model_args_from_hf_config(hf_config(m.args))
    assert args.to_dict() == {**m.args.to_dict(), "init_std": args.init_std}


def test_layer_count_of_weight_names_is_one_function():
    """model.layer_count is what both stored-weight checks count layers with (utils/run.py's
    checkpoint check, utils/hf/import_hf.py's safetensors and GGUF checks; their refusals are
    tested in test_checkpoint.py and test_export.py): our names, Hugging Face's, GGUF's; 0 for
    none; only a name that starts with the pattern counts."""
    m = build(n_layers=3)
    assert M.layer_count(m.state_dict()) == 3
    assert M.layer_count(to_hf_state_dict(m), r"model\.layers\.(\d+)\.") == 3
    assert M.layer_count(["token_embd.weight", "blk.0.attn_q.weight", "blk.6.ffn_up.weight"],
                         r"blk\.(\d+)\.") == 7
    assert M.layer_count(["norm.weight", "tok_embeddings.weight"]) == 0
    assert M.layer_count(["model.layers.4.mlp.w_up.weight"]) == 0       # not at the start: ours


@pytest.mark.parametrize("field", ["norm_eps", "rope_theta", "init_std", "dropout"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), "big"])
def test_model_args_refuse_a_float_that_is_not_a_finite_number(field, value):
    """An import of a config with rope_theta Infinity used to pass (inf > 0) and then be
    exported as "rope_theta": Infinity, which is not JSON."""
    with pytest.raises(ConfigError, match=f"model.{field}: expected a finite number"):
        tiny(**{field: value})


@pytest.mark.parametrize("act,fn", [("swiglu", F.silu), ("geglu", F.gelu), ("reglu", F.relu)])
def test_gated_mlp_math(act, fn):
    torch.manual_seed(0)
    mlp = GatedMLP(16, 48, act)
    x = torch.randn(2, 5, 16)
    want = (fn(x @ mlp.w_gate.weight.T) * (x @ mlp.w_up.weight.T)) @ mlp.w_down.weight.T
    torch.testing.assert_close(mlp(x), want)
    assert llama_ffn_hidden(384) == 1024 and llama_ffn_hidden(64, 64) == 192 and llama_ffn_hidden(768) == 2048


def test_layernorm_option_builds_and_trains():
    m = build(norm="layernorm").train()
    assert isinstance(m.norm, torch.nn.LayerNorm) and m.norm.bias is None
    x = torch.randint(0, V, (2, 12))
    _, loss = m(x, x, return_logits=False)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    assert not any(n.endswith("bias") for n, _ in m.named_parameters())


# --------------------------------------------------------------------------- RoPE and GQA
def test_rope_tables_shapes_and_relative_positions():
    cos, sin = M.rope_tables(8, 20, 10_000.0)
    assert cos.shape == sin.shape == (20, 8) and cos.dtype == torch.float32
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def rot(x, p):
        return M.apply_rope(x, cos[p:p + 1], sin[p:p + 1])
    # the score depends only on the distance between positions; norms are preserved
    s1 = (rot(q, 7) * rot(k, 3)).sum()
    s2 = (rot(q, 14) * rot(k, 10)).sum()
    torch.testing.assert_close(s1, s2)
    torch.testing.assert_close(rot(q, 5).norm(), q.norm())
    # per-row positions (B, T, hd) broadcast over heads
    x = torch.randn(2, 3, 4, 8)
    pos = torch.tensor([[0, 1, 2], [5, 6, 7]])
    y = M.apply_rope(x, cos[pos], sin[pos])
    torch.testing.assert_close(y[1], M.apply_rope(x[1:], cos[5:8], sin[5:8])[0])


def test_gqa_shapes_and_equivalence_to_repeated_heads():
    gqa = build(n_kv_heads=2)
    a = gqa.layers[0].attn
    hd = gqa.args.head_dim
    assert a.wq.weight.shape == (4 * hd, 32) and a.wk.weight.shape == (2 * hd, 32)
    assert a.wv.weight.shape == (2 * hd, 32) and a.wo.weight.shape == (32, 4 * hd)
    # a multi-head model whose k/v heads repeat the GQA ones computes the same function
    mha = create_model(tiny(n_kv_heads=4)).eval()
    sd = gqa.state_dict()
    for i in range(2):
        for w in ("wk", "wv"):
            key = f"layers.{i}.attn.{w}.weight"
            sd[key] = sd[key].view(2, hd, 32).repeat_interleave(2, dim=0).reshape(4 * hd, 32)
    mha.load_state_dict(sd)
    x = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        logits, _ = gqa(x)
        assert logits.shape == (2, 10, V)
        torch.testing.assert_close(logits, mha(x)[0], atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- document mask
def test_document_mask_equals_each_document_alone():
    m = build(document_mask=True)
    plain = create_model(tiny()).eval()
    plain.load_state_dict(m.state_dict())
    torch.manual_seed(3)
    docs = [[1] + torch.randint(3, V, (n,)).tolist() for n in (6, 3, 9)]
    lead = torch.randint(3, V, (4,)).tolist()          # a window may start mid-document
    row0 = lead + docs[0] + docs[1] + docs[2]
    row1 = docs[2] + docs[0] + docs[1] + lead
    x = torch.tensor([row0, row1])
    with torch.no_grad():
        got = m(x)[0]
        pieces0 = [lead] + docs
        pieces1 = [docs[2], docs[0], docs[1] + lead]   # no BOS: the tail continues docs[1]
        for r, pieces in enumerate((pieces0, pieces1)):
            want = torch.cat([plain(torch.tensor([p]))[0][0] for p in pieces])
            torch.testing.assert_close(got[r], want, atol=1e-5, rtol=0)
        # without the option the same window attends across documents
        assert not torch.allclose(plain(x)[0], got, atol=1e-3)
        # a window holding one document takes the plain causal path and agrees with it
        one = torch.tensor([docs[0] + lead])
        torch.testing.assert_close(m(one)[0], plain(one)[0])
    # the fused loss and its gradients work through the mask
    m.train()
    _, loss = m(x[:, :-1], x[:, 1:], return_logits=False)
    loss.backward()
    assert torch.isfinite(loss) and m.layers[0].attn.wq.weight.grad.abs().sum() > 0


def test_document_mask_needs_bos():
    with pytest.raises(ConfigError, match="document_mask"):
        tiny(document_mask=True, bos_id=None)


# --------------------------------------------------------------------------- loss
def test_fused_loss_matches_plain_loss_and_gradients():
    torch.manual_seed(0)
    args = tiny(tie_embeddings=True)
    m1 = create_model(args).train()
    m2 = create_model(args).train()
    m2.load_state_dict(m1.state_dict())
    m2.loss_chunk_rows = 7                        # several chunks, a ragged last one
    x = torch.randint(0, V, (3, 16))
    y = torch.randint(0, V, (3, 16))
    y[0, :5] = -100
    mask = (torch.rand(3, 16) > 0.3).float()
    logits, l1 = m1(x, y, loss_mask=mask)
    none, l2 = m2(x, y, loss_mask=mask, return_logits=False)
    assert none is None and logits.shape == (3, 16, V)
    # the reference: mean cross-entropy over positions both counted and unmasked
    keep = (y != -100) & (mask > 0)
    ref = F.cross_entropy(logits[keep].float(), y[keep])
    torch.testing.assert_close(l1, ref)
    torch.testing.assert_close(l2, ref, atol=1e-6, rtol=1e-6)
    l1.backward()
    l2.backward()
    for (n, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, atol=1e-6, rtol=1e-4, msg=n)
    # nothing counted: loss 0, not NaN; eval (no grad) uses the same fused path
    _, zero = m2(x, torch.full_like(y, -100), return_logits=False)
    assert zero.item() == 0.0
    with torch.no_grad():
        _, l3 = m2.eval()(x, y, loss_mask=mask, return_logits=False)
    torch.testing.assert_close(l3, ref.detach(), atol=1e-6, rtol=1e-6)


def test_bf16_autocast_loss_close_to_fp32():
    m = build().train()
    x = torch.randint(0, V, (2, 16))
    _, ref = m(x, x, return_logits=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, lb = m(x, x, return_logits=False)
        _, lb2 = m(x, x)
    assert lb.dtype == torch.float32 and abs(lb.item() - ref.item()) < 0.05
    assert abs(lb2.item() - lb.item()) < 0.05
    lb.backward()
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in m.parameters())


# --------------------------------------------------------------------------- generation
# --------------------------------------------------------------------------- args, presets, config
def test_model_args_round_trip_and_unknown_keys():
    a = tiny(activation="geglu", tie_embeddings=False)
    assert ModelArgs.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    with pytest.raises(ConfigError, match="model.n_layer: unknown"):
        ModelArgs.from_dict({**a.to_dict(), "n_layer": 3})
    with pytest.raises(ConfigError) as e:
        tiny(n_heads=3, n_kv_heads=2, d_model=32)
    assert "must divide" in str(e.value) and "must be divisible" in str(e.value)


def test_presets_and_explicit_keys():
    cfg = load_config(base_file=None)
    assert cfg.model.preset == "default"
    a = model_args_from_config(cfg, 32016, 1)
    assert (a.d_model, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_hidden) == (384, 8, 6, 2, 1024)
    n = create_model(a).num_params()
    assert 24e6 < n < 26e6                                    # the seed's "~25M parameters"
    # explicit keys override the preset; unset ones keep the preset's values
    cfg = load_config(base_file=None, overrides={"model.preset": "125m", "model.n_layers": 2})
    a = model_args_from_config(cfg, 32016, 1)
    assert (a.d_model, a.n_layers, a.n_kv_heads, a.tie_embeddings) == (768, 2, 4, False)
    for name, shape in MODEL_PRESETS.items():
        c = Config()
        c.model.preset = name
        a = model_args_from_config(c, 32016, 1)
        assert a.d_model == shape["d_model"] and a.n_layers == shape["n_layers"]
    # custom needs every shape key
    with pytest.raises(ConfigError, match="model.d_model: must be set"):
        load_config(base_file=None, overrides={"model.preset": "custom", "model.n_layers": 2})
    c = Config()
    c.model.vocab_size = 100
    with pytest.raises(ConfigError, match="smaller than the tokenizer"):
        model_args_from_config(c, 32016, 1)


def test_cross_checks_are_configuration_errors(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(base_file=None, overrides={"model.d_model": 100, "model.n_heads": 6,
                                               "model.n_kv_heads": 4, "dataset.window": 1024})
    text = str(e.value)
    assert "model.n_kv_heads: 4 must divide model.n_heads (6)" in text
    assert "model.d_model: 100 must be divisible by model.n_heads (6)" in text
    assert "dataset.window: 1024 exceeds model.max_seq_len (512)" in text


def test_bad_model_config_exits_2_from_the_cli(tmp_config):
    cfg = tmp_config({"model": {"n_heads": 6, "n_kv_heads": 4}})
    proc = run_stage("train", "--config", cfg, "--test", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "model.n_kv_heads: 4 must divide model.n_heads (6)" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_sizes_and_flops():
    m = build(tie_embeddings=False)
    a = m.args
    emb = V * 32
    assert m.num_params() == m.num_params(non_embedding=True) + 2 * emb
    per_layer = 32 * 32 * 2 + 2 * 32 * 16 + 3 * 32 * a.ffn_hidden + 2 * 32
    assert m.num_params(non_embedding=True) == 2 * per_layer + 32
    assert m.flops_per_token(10) == 6 * (m.num_params(True) + emb) + 12 * 2 * 32 * 10


# --------------------------------------------------------------------------- CUDA paths (GPU box)
@cuda
def test_cuda_bf16_paths_match_sdpa():
    torch.manual_seed(0)
    args = tiny(d_model=128, n_heads=4, n_kv_heads=2, document_mask=True)
    m = create_model(args).cuda().eval()
    ref = create_model(tiny(d_model=128, n_heads=4, n_kv_heads=2)).cuda().eval()
    ref.load_state_dict(m.state_dict())
    docs = [[1] + list(range(3, 3 + n)) for n in (10, 5, 20)]
    x = torch.tensor([sum(docs, [])], device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        got = m(x)[0].float()              # flash varlen, or flex attention, per what is installed
        want = torch.cat([ref(torch.tensor([d], device="cuda"))[0][0].float() for d in docs])
        plain_flash = ref(x)[0].float()    # flash-attn when importable, else SDPA
        plain_sdpa = ref.cpu().float()(x.cpu())[0]
    assert (got[0] - want).abs().max() < 5e-2
    assert (plain_flash.cpu() - plain_sdpa).abs().max() < 5e-2


@cuda
def test_cuda_bf16_generation_and_fused_loss():
    m = build(seed=3).cuda().to(torch.bfloat16)
    out = Engine(m).generate([[1, 2, 3], [4, 5]], 10, temperature=0.7, top_k=10, seed=1)
    assert out == Engine(m).generate([[1, 2, 3], [4, 5]], 10, temperature=0.7, top_k=10, seed=1)
    m = build(seed=3).cuda().train()
    x = torch.randint(0, V, (2, 32), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, a = m(x, x, return_logits=False)
        _, b = m(x, x)
    assert math.isfinite(a.item()) and abs(a.item() - b.item()) < 0.05


def test_model_schema_is_defined_once():
    """ModelArgs is the schema: config.json's model section has every one of its fields (with
    the same defaults where the config gives one), model_args_from_config copies them by name,
    and the Hugging Face mapping covers each field (by its table or by hand)."""
    import dataclasses
    from utils.config import ModelConfig
    from utils.hf.mapping import HF_CONFIG_NAMES, SPECIAL_FIELDS
    args = {f.name: f for f in dataclasses.fields(ModelArgs)}
    cfg = {f.name: f for f in dataclasses.fields(ModelConfig)}
    from_tokenizer = {"vocab_size", "bos_id"}
    assert set(args) - from_tokenizer <= set(cfg), set(args) - from_tokenizer - set(cfg)
    for name in set(args) - from_tokenizer:
        if cfg[name].default is not None:            # null in the config: from the preset
            assert cfg[name].default == args[name].default, name
    assert set(HF_CONFIG_NAMES) | set(SPECIAL_FIELDS) == set(args)
    assert not set(HF_CONFIG_NAMES) & set(SPECIAL_FIELDS)
    m = model_args_from_config(Config(), 500, 1)
    assert (m.vocab_size, m.bos_id, m.d_model) == (500, 1, MODEL_PRESETS["default"]["d_model"])


def test_rope_tables_first_made_in_inference_mode_serve_training_later():
    """Generation before any training step (RL's rollouts) makes the cached RoPE tables first,
    inside inference mode: training afterwards must still backpropagate through them."""
    from model import ModelArgs, create_model
    torch.manual_seed(0)
    m = create_model(ModelArgs(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=16))
    with torch.inference_mode():
        m(torch.zeros(1, 4, dtype=torch.long))
    _, loss = m(torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 8, dtype=torch.long))
    loss.backward()
    assert m.tok_embeddings.weight.grad is not None
