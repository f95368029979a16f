"""What evaluation and the trainer's samples cost, and what a training run says about its
attention kernel and MFU.

- The fused loss under ``torch.no_grad()`` / ``torch.inference_mode()`` computes the loss
  alone: no matmul produces the head's (vocab, d_model) gradient (counted with a
  TorchDispatchMode over the real forward), while a forward with grad enabled still
  computes it in the same pass (the training path is unchanged).
- The trainer's samples (generation in eval mode) do not leave generation's transposed weight
  copy on the model: checked on every batch the trainer draws after a validation, and after
  ``fit`` returns, on a real Trainer over a real shard set.
- ``python main.py train`` on CPU says once which attention path it uses and why, and why
  MFU is not logged (one line each, also in the log's start event).
"""
from __future__ import annotations

import json
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model import ModelArgs, create_model
from tests.conftest import SPM_MODEL, write_config
import utils.generation.engine as E

V, D = 211, 32


class _HeadGradMatmuls(TorchDispatchMode):
    """Counts matrix products whose result has the head weight's shape (vocab, d_model)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (V, D):
                self.count += 1
        return out


def _model_and_batch(tie: bool):
    torch.manual_seed(0)
    m = create_model(ModelArgs(vocab_size=V, d_model=D, n_layers=2, n_heads=4, n_kv_heads=2,
                               max_seq_len=64, tie_embeddings=tie))
    m.loss_chunk_rows = 64                       # several chunks: 4 x 48 = 192 rows
    x = torch.randint(0, V, (4, 48))
    y = torch.randint(0, V, (4, 48))
    return m, x, y


@pytest.mark.parametrize("tie", [True, False])
def test_evaluation_computes_the_loss_alone(tie):
    m, x, y = _model_and_batch(tie)
    counts, losses = {}, {}
    for mode, ctx in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode),
                      ("grad", torch.enable_grad)):
        with ctx(), _HeadGradMatmuls() as probe:
            _, loss = m(x, y, return_logits=False)
        counts[mode], losses[mode] = probe.count, float(loss.detach())
    assert counts["no_grad"] == 0 and counts["inference_mode"] == 0, counts
    assert counts["grad"] == 3, counts           # one head-gradient product per row chunk
    assert losses["no_grad"] == losses["inference_mode"] == pytest.approx(losses["grad"], abs=1e-6)


def test_evaluation_allocates_no_head_gradient_buffer():
    """Peak memory of an evaluation call, from torch's own CPU allocation events."""
    from torch.profiler import ProfilerActivity, profile
    m, x, y = _model_and_batch(tie=False)
    head_bytes = V * D * 4

    def allocations(ctx) -> list[int]:
        with ctx(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            m(x, y, return_logits=False)
        return [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]

    assert head_bytes not in allocations(torch.no_grad)      # no (vocab, d) fp32 buffer
    assert head_bytes in allocations(torch.enable_grad)      # the probe sees it when it exists


class _WatchedBatches:
    """The real train loader, recording whether any decode pack generation made is still
    alive each time the trainer draws a batch (so, between optimizer steps, after samples)."""

    def __init__(self, loader, packs):
        self.loader, self.packs, self.seen = loader, packs, []

    def __iter__(self):
        for b in self.loader:
            self.seen.append(any(ref() is not None for ref in self.packs))
            yield b

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, s):
        self.loader.load_state_dict(s)

    @property
    def epoch(self):
        return self.loader.epoch


def test_trainer_samples_leave_no_decode_pack(tmp_path, train_shards, monkeypatch):
    import dataloader
    from model import model_args_from_config
    from utils.config import load_config
    from utils.training.logging_utils import DualLogger
    from utils.data.tok import load_tokenizer
    from utils.training.trainer import OptimizerSpec, Settings, Trainer, TrainSpec, seed_everything

    cfg = load_config(write_config(tmp_path, {
        "tokenizer": {"name": str(SPM_MODEL)},
        "dataset": {"wikipedia_test_dir": str(train_shards), "window": 32},
        "model": {"preset": "tiny", "max_seq_len": 32},
        "training": {"batch_size": 4, "eval_steps": 3, "eval_batches": 2, "dtype": "fp32",
                     "device": "cpu", "warmup_steps": 1}}), test=True)
    tok = load_tokenizer(cfg)
    train, val, _ = dataloader.build_loaders(cfg, tok, device="cpu")
    args = model_args_from_config(cfg, len(tok), tok.bos_token_id)
    seed_everything(0)
    model = create_model(args)
    packs = []                            # weak references to every decode pack made
    make_pack = E.Engine.decode_pack

    def recorded(self):
        pack = make_pack(self)
        if pack is not None and all(ref() is not pack.head for ref in packs):
            packs.append(weakref.ref(pack.head))
        return pack
    monkeypatch.setattr(E.Engine, "decode_pack", recorded)

    def sample_fn(m):                     # what train.py's sample_fn does: generate, decode
        out = E.generate(m, [[tok.bos_token_id, 5, 6]], max_new_tokens=4, temperature=0.8,
                         top_k=50, eos_id=tok.eos_token_id, seed=1)
        return [("p", tok.decode(out[0]))]

    watched = _WatchedBatches(train, packs)
    logger = DualLogger("pack", tmp_path / "logs", tensorboard=False)
    spec = TrainSpec(model, args, watched, val, optimizer=OptimizerSpec.from_config(cfg.training),
                     settings=Settings.from_config(cfg.training, cfg.logging, 7),
                     sample_fn=sample_fn)
    trainer = Trainer(spec, run_dir=tmp_path / "run", logger=logger, device="cpu", progress=False)
    result = trainer.fit()
    logger.close()
    assert result.reason == "done" and result.step == 7
    assert len(packs) >= 3                                                 # generation packed
    assert len(watched.seen) >= 7 and not any(watched.seen), watched.seen  # never while training
    assert all(ref() is None for ref in packs) and model.training


def test_train_says_its_attention_path_and_why_no_mfu(trained_run):
    out = trained_run["out"]                             # the shared run (tests/conftest.py)
    attention = [ln for ln in out.splitlines() if ln.startswith("attention:")]
    assert attention == ["attention: PyTorch SDPA with is_causal (flash-attn and flex attention "
                         "run on CUDA only, this is cpu)."], attention
    mfu = [ln for ln in out.splitlines() if "MFU" in ln]
    assert mfu == ["note: MFU is not logged: no peak FLOP/s is known for CPU devices (MFU is "
                   "reported on CUDA GPUs)."], mfu
    recs = [json.loads(x) for x in
            (trained_run["root"] / "logs" / "raw_metrics" / "base.jsonl").read_text().splitlines()]
    start = [r for r in recs if r.get("type") == "event" and r.get("event") == "start"]
    assert len(start) == 1 and "CPU devices" in start[0]["mfu_unavailable"]
    assert all("mfu" not in r for r in recs if r.get("type") == "train")


def test_attention_path_names_the_cuda_kernels_reasons():
    """The rule on CUDA, without a GPU: fp32 never takes flash-attn; a missing flash-attn is
    named with its import error."""
    import utils.attention as A
    m = create_model(ModelArgs(vocab_size=V, d_model=D, n_layers=1, n_heads=4, n_kv_heads=2,
                               max_seq_len=16))
    assert "flash-attn needs fp16/bf16" in m.attention_path("cuda", torch.float32)
    if A.flash_attn():
        pytest.fail("flash-attn is importable on this CPU machine; this check expects it absent")
    assert f"flash-attn is not importable ({A.flash_backend()[1]})" in m.attention_path("cuda", torch.bfloat16)
    assert A.flash_backend()[1].startswith(("ImportError", "ModuleNotFoundError"))


@pytest.mark.parametrize("tie", [True, False])
def test_muon_groups_pick_the_head_by_role_not_by_shape(tie):
    """A hidden matrix with vocab_size outputs (MLP width = vocabulary) is Muon's; embeddings
    and the head are AdamW's, found by their role. LlamaForCausalLM's head likewise."""
    from types import SimpleNamespace
    from utils.training.trainer import build_optimizers
    args = ModelArgs(vocab_size=96, d_model=D, n_layers=2, n_heads=4, n_kv_heads=2,
                     max_seq_len=16, ffn_hidden=96, tie_embeddings=tie)
    m = create_model(args)
    hp = SimpleNamespace(optimizer="muon", lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1,
                         muon_momentum=0.95)
    opts = build_optimizers(m, hp, torch.device("cpu"))
    muon = {id(p) for g in opts["muon"].param_groups for p in g["params"]}
    adamw = {id(p) for g in opts["adamw"].param_groups for p in g["params"]}
    assert m.layers[0].mlp.w_gate.weight.shape[0] == 96
    for b in m.layers:
        for w in (b.mlp.w_gate.weight, b.mlp.w_up.weight, b.mlp.w_down.weight, b.attn.wq.weight):
            assert id(w) in muon
    assert id(m.tok_embeddings.weight) in adamw and id(m.lm_head.weight) in adamw
    assert not muon & adamw

    from transformers import LlamaForCausalLM
    from utils.hf.mapping import hf_config
    hf = LlamaForCausalLM(hf_config(args))
    opts = build_optimizers(hf, hp, torch.device("cpu"))
    muon = {id(p) for g in opts["muon"].param_groups for p in g["params"]}
    assert id(hf.get_output_embeddings().weight) not in muon
    assert id(hf.model.layers[0].mlp.gate_proj.weight) in muon
