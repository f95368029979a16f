"""FSDP2 (`--parallel fsdp`) on two CPU ranks (gloo): the same training as one process, sharded
checkpoints (DCP folders) that resume exactly after SIGTERM and on another number of
processes, damage named, and every reader taking them as it takes a file.

FSDP2 runs on CPU with gloo in this PyTorch (torch 2.13): ``fully_shard``'s all-gather and
reduce-scatter, and DCP's save and load, all work on gloo (docs/training.md, FSDP2).

Runs (the tiny model and shard set of tests/test_train.py; windows of 32 tokens; every step
checkpointed; gradient accumulation 2):

- ``single``: one process, batch 2B (``--parallel fsdp`` on one process: nothing to shard, the
  checkpoints are DCP folders of world size 1), in this process;
- ``full``: the user's launch, `main.py train --nproc-per-node 2 --parallel fsdp`, batch B per
  rank, with activation checkpointing: the same global batch as ``single``;
- ``cut``: two ranks continuing ``full``'s step-1 checkpoint, stopped by SIGTERM after step 3;
- ``grow``: two ranks continuing ``single``'s step-2 checkpoint (1 -> 2 processes), with
  activation checkpointing and ``--compile`` (dynamo with the ``aot_eager`` backend: the tracing
  under FSDP2 without inductor's code generation, which takes minutes on this CPU).
- ``inductor``: two ranks from scratch with ``--compile`` as a user runs it (inductor), compared
  with ``full``; marked ``slow`` (--runslow) for inductor's minutes.

Tolerances are test_ddp.py's (:func:`tests.test_ddp.assert_same_training`): the two sum the
same numbers in another order, so step 1's loss agrees to float32 rounding (tokens x 2**-24,
relative), its gradients to 1e-4 of each tensor's largest, later losses to 1e-4 and weights
to the bound Adam's step size gives. A resume on the same world size is exact (bitwise).
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import zlib

import pytest
import torch

from tests.conftest import (ROOT, SPM_MODEL, default_signals, main_command, paused_env, run_stage,
                            wait_for_line, write_config)
from tests.test_ddp import LATER_LOSS_RTOL, adam_step_bound, assert_same_training, max_diff
from tests.test_train import FLAGS, log_of, losses, ok, train
from utils.run import load_checkpoint
from utils.training import sharded
from utils.training.checkpoint import CheckpointError

B = 2                # windows per rank per micro-batch (one process: 2 * B)
ACCUM = 2
STEPS = 4
RUN = ["--parallel", "fsdp", "--grad-accum", ACCUM, "--checkpoint-every", 1,
       "--keep-checkpoints", STEPS + 1, "--max-steps", STEPS, "--sample-tokens", 0]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp_root")


@pytest.fixture(scope="module")
def cfg(root, train_shards):
    return write_config(root, {"tokenizer": {"name": str(SPM_MODEL)},
                               "dataset": {"wikipedia_test_dir": str(train_shards)}})


def two_ranks(cfg, *args) -> list:
    """The user's launch: `main.py train ... --nproc-per-node 2` (its arguments)."""
    return ["train", "--test", "--config", cfg, *FLAGS, *RUN, "--batch-size", B, *args,
            "--nproc-per-node", 2]


def ckpt(root, run, name) -> dict:
    return load_checkpoint(root / "checkpoints" / run / name, "resume")


def steps_of(root, run, first=1, last=STEPS) -> list[dict]:
    return [ckpt(root, run, f"checkpoint_step_{k}.dcp") for k in range(first, last + 1)]


def weight_bound(c: dict) -> float:
    """How far two runs' weights after STEPS steps may be apart (test_ddp's bound: Adam's step
    size at checkpoint ``c``'s learning rate, per run)."""
    group = c["optimizer"]["adamw"]["param_groups"][0]
    return 2 * group["lr"] * adam_step_bound(STEPS, *group["betas"])


def continue_from(root, source: str, name: str, run: str) -> None:
    """Run folder ``run`` holding a copy of ``source``'s checkpoint ``name`` as its latest."""
    folder = root / "checkpoints" / run
    folder.mkdir(parents=True)
    shutil.copytree(root / "checkpoints" / source / name, folder / "checkpoint_latest.dcp")


@pytest.fixture(scope="module")
def single(root, cfg):
    return ok(train(cfg, *RUN, "--batch-size", 2 * B, "--name", "single"))


@pytest.fixture(scope="module")
def full(root, cfg):
    """Two ranks from scratch; the launcher (torchrun's agent) runs in this process, the ranks
    are its subprocesses."""
    return ok(run_stage(*two_ranks(cfg, "--name", "full", "--activation-checkpointing")))


@pytest.fixture(scope="module")
def cut(root, cfg, full):
    """``full``'s step 1 continued on two ranks; SIGTERM to main.py after step 3."""
    continue_from(root, "full", "checkpoint_step_1.dcp", "cut")
    p = subprocess.Popen(main_command(*two_ranks(cfg, "--name", "cut", "--resume", "auto")), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT, env=paused_env(3),
                         stdin=subprocess.DEVNULL, preexec_fn=default_signals, start_new_session=True)
    wait_for_line(p, "paused after step 3")
    os.kill(p.pid, signal.SIGTERM)
    out, err = p.communicate(timeout=240)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_two_ranks_train_as_one_process_with_the_same_global_batch(root, single, full):
    hp = next(r for r in log_of(root, "full") if r["type"] == "config")["hparams"]
    assert hp["parallel"] == "fsdp" and hp["world_size"] == 2 and hp["activation_checkpointing"]
    f_steps, s_steps = steps_of(root, "full"), steps_of(root, "single")
    lf, ls = losses(log_of(root, "full")), losses(log_of(root, "single"))
    assert sorted(lf) == sorted(ls) == list(range(1, STEPS + 1))
    assert_same_training(f_steps, s_steps, lf, ls, tokens=ACCUM * 2 * B * 32)
    for f, s in zip(f_steps, s_steps):
        assert f["sharded"]["world_size"] == 2 and s["sharded"]["world_size"] == 1
        assert f["tokens_seen"] == s["tokens_seen"] and len(f["rng"]["ranks"]) == 2
        # rank 0 read half of each global micro-batch
        assert f["data_position"]["index"] == s["data_position"]["index"] // 2
    # each rank wrote its own shard file; the manifest lists them with their checksums
    folder = root / "checkpoints" / "full" / "checkpoint_latest.dcp"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert sorted(manifest) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]      # no temp left
    assert not list(folder.parent.glob("*.pt"))


def test_sigterm_then_resume_on_two_ranks_is_exact(root, full, cut):
    assert cut.returncode == 130, f"{cut.stdout}\n{cut.stderr}"
    assert "the 2 ranks were stopped by SIGTERM" in cut.stderr and "Traceback" not in cut.stderr
    assert "--parallel fsdp" in cut.stderr and "--name cut --resume auto --nproc-per-node 2" in cut.stderr
    a, b = ckpt(root, "full", "checkpoint_step_3.dcp"), ckpt(root, "cut", "checkpoint_latest.dcp")
    assert b["step"] == 3
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = a["optimizer"]["adamw"]["state"], b["optimizer"]["adamw"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][s], sb[i][s]) for i in sa for s in sa[i])
    assert len(b["rng"]["ranks"]) == 2 and b["rng"]["world_size"] == 2
    lf, lc = losses(log_of(root, "full")), losses(log_of(root, "cut"))
    assert sorted(lc) == [2, 3] and all(lc[k] == lf[k] for k in lc)


def test_two_rank_checkpoint_continues_on_one_process(root, cfg, full, cut):
    """2 -> 1: the same global window, the batch doubled: the steps of the two-rank run."""
    continue_from(root, "cut", "checkpoint_latest.dcp", "shrink")
    r = ok(train(cfg, *RUN, "--batch-size", 2 * B, "--name", "shrink", "--resume", "auto"))
    assert "written by 2 process(es), this run has 1" in r.stdout
    lf, lr = losses(log_of(root, "full")), losses(log_of(root, "shrink"))
    assert sorted(lr) == [4]
    assert all(abs(lr[k] - lf[k]) <= LATER_LOSS_RTOL * lf[k] for k in lr), (lr, lf)
    a, b = ckpt(root, "full", "checkpoint_latest.dcp"), ckpt(root, "shrink", "checkpoint_latest.dcp")
    assert b["step"] == STEPS and b["sharded"]["world_size"] == 1
    assert 0 < max_diff(a["model"], b["model"]) <= weight_bound(a)


def test_one_process_checkpoint_continues_on_two_ranks_compiled(root, cfg, single, full, tmp_path):
    """1 -> 2: DCP reshards the one-process checkpoint into the ranks' shards; the ranks run
    their blocks checkpointed, compiled and sharded (torchtitan's order), through dynamo with the
    ``aot_eager`` backend (torch's own override, TORCH_COMPILE_OVERRIDE_BACKENDS: the graphs
    dynamo and AOTAutograd trace around FSDP2's hooks, without inductor's minutes of codegen)."""
    continue_from(root, "single", "checkpoint_step_2.dcp", "grow")
    graphs = tmp_path / "graphs.log"
    with pytest.MonkeyPatch.context() as mp:       # the ranks inherit this process's environment
        mp.setenv("TORCH_COMPILE_OVERRIDE_BACKENDS", ">=0:aot_eager")
        mp.setenv("TORCH_LOGS", "graph_code")
        mp.setenv("TORCH_LOGS_OUT", str(graphs))
        ok(run_stage(*two_ranks(cfg, "--name", "grow", "--resume", "auto", "--compile",
                                "--activation-checkpointing")))
    hp = next(r for r in log_of(root, "grow") if r["type"] == "config")["hparams"]
    assert hp["compile"] and hp["activation_checkpointing"] and hp["world_size"] == 2
    # dynamo traced the blocks on both ranks (TORCH_LOGS graph_code: the graphs it compiled)
    traced = set(re.findall(r"\[rank(\d)\]:.* class GraphModule\(", graphs.read_text()))
    assert traced == {"0", "1"}, graphs.read_text()[:2000]
    ls, lg, lf = losses(log_of(root, "single")), losses(log_of(root, "grow")), losses(log_of(root, "full"))
    assert sorted(lg) == [3, 4]
    assert all(abs(lg[k] - ls[k]) <= LATER_LOSS_RTOL * ls[k] for k in lg), (lg, ls)
    assert all(abs(lg[k] - lf[k]) <= LATER_LOSS_RTOL * lf[k] for k in lg), (lg, lf)   # eager FSDP
    g, s = ckpt(root, "grow", "checkpoint_latest.dcp"), ckpt(root, "single", "checkpoint_latest.dcp")
    assert g["step"] == 4 and g["sharded"]["world_size"] == 2 and len(g["rng"]["ranks"]) == 2
    assert g["model"].keys() == s["model"].keys()              # no compile wrapper in the names
    assert 0 < max_diff(g["model"], s["model"]) <= weight_bound(s)
    # the same global windows: rank 0 is at half the one process's position
    assert g["data_position"]["index"] == s["data_position"]["index"] // 2


@pytest.mark.slow      # inductor generates and builds C++ for the blocks: minutes on this CPU
def test_two_ranks_compiled_by_inductor_train_as_the_eager_ranks(root, cfg, full):
    """``--compile`` as a user runs it (inductor) on two sharded ranks: the eager run's steps."""
    ok(run_stage(*two_ranks(cfg, "--name", "inductor", "--compile", "--activation-checkpointing")))
    lf, li = losses(log_of(root, "full")), losses(log_of(root, "inductor"))
    assert sorted(li) == list(range(1, STEPS + 1))
    assert all(abs(li[k] - lf[k]) <= LATER_LOSS_RTOL * lf[k] for k in li), (li, lf)
    a, b = ckpt(root, "full", "checkpoint_latest.dcp"), ckpt(root, "inductor", "checkpoint_latest.dcp")
    assert max_diff(a["model"], b["model"]) <= weight_bound(a)


def _flip_byte(path, offset_fraction=0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * offset_fraction)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_or_missing_shard_is_named_not_loaded(root, cfg, full):
    continue_from(root, "full", "checkpoint_latest.dcp", "damaged")
    folder = root / "checkpoints" / "damaged" / "checkpoint_latest.dcp"
    _flip_byte(folder / "__1_0.distcp")
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: corrupt"):
        load_checkpoint(folder, "weights")
    r = train(cfg, *RUN, "--batch-size", 2 * B, "--name", "damaged", "--resume", "auto")
    assert r.returncode == 1 and "__1_0.distcp: corrupt" in r.stderr and "Traceback" not in r.stderr
    r = run_stage("infer", "--config", cfg, "--checkpoint", folder, "--prompt", "The", "--max-new-tokens", 2)
    assert r.returncode == 1 and "__1_0.distcp: corrupt" in r.stderr, r.stderr
    (folder / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: missing"):
        load_checkpoint(folder, "weights")


def test_a_forged_index_is_refused_without_running_it(root, full, tmp_path):
    """DCP's .metadata is a pickle: one that would run a command is refused (nothing runs),
    even with a manifest forged to match it."""
    folder = tmp_path / "checkpoint_latest.dcp"
    shutil.copytree(root / "checkpoints" / "full" / "checkpoint_latest.dcp", folder)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    manifest = json.loads((folder / "manifest.json").read_text())
    data = (folder / ".metadata").read_bytes()
    manifest[".metadata"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="index is damaged or not DCP's.*system"):
        load_checkpoint(folder, "weights")
    assert not marker.exists()
    # the metadata module's other names (a module object: BUILD could overwrite its attributes)
    for name in ("os", "torch", "dataclass"):
        data = f"ctorch.distributed.checkpoint.metadata\n{name}\n.".encode()
        (folder / ".metadata").write_bytes(data)
        manifest[".metadata"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
        (folder / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match=f"not part of DCP's metadata"):
            load_checkpoint(folder, "weights")


def test_a_save_killed_between_its_renames_leaves_the_previous_checkpoint(root, full):
    """The one moment a sharded save has no folder under its name (old one moved aside, new one
    not yet in place), and a half-written temp folder: a reader gets the previous checkpoint and
    changes nothing; the run's own next start puts it back (tests/test_multinode.py: across
    hosts, and through the train stage)."""
    continue_from(root, "full", "checkpoint_step_3.dcp", "killed")
    folder = root / "checkpoints" / "killed"
    latest = folder / "checkpoint_latest.dcp"
    dead = _dead_pid()
    latest.rename(sharded.aside(latest, "old", pid=dead))
    sharded.aside(latest, "tmp", pid=dead).mkdir()
    (sharded.aside(latest, "tmp", pid=dead) / "__0_0.distcp").write_bytes(b"half")
    left = sorted(p.name for p in folder.iterdir())
    got = load_checkpoint(latest, "resume")
    assert got["step"] == 3
    assert sorted(p.name for p in folder.iterdir()) == left
    said = sharded.recover(folder)
    assert sorted(line.split(":")[0] for line in said) == [
        "put checkpoint_latest.dcp back",
        f"removed {sharded.aside(latest, 'tmp', pid=dead).name}, left by a save of pid {dead} on this host "
        "that did not finish"]
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint_latest.dcp"]


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_muon_is_refused_with_the_alternatives(cfg):
    r = train(cfg, "--parallel", "fsdp", "--optimizer", "muon", "--name", "muon")
    assert r.returncode == 2, r.stderr
    assert "needs whole matrices" in r.stderr and "--optimizer adamw with --parallel fsdp" in r.stderr
    assert "Muon with --parallel ddp" in r.stderr


def test_a_second_run_under_the_same_name_is_refused_as_a_plain_one_is(root, cfg, single):
    """Starting an FSDP run again under the same --name without --resume was not refused (the
    check looked for checkpoint_latest.pt; an FSDP run writes checkpoint_latest.dcp): the second
    run replaced the first one's checkpoints. Now it is refused, naming the fix, as a plain run."""
    folder = root / "checkpoints" / "single"
    before = {p.name: p.stat().st_mtime_ns for p in folder.rglob("*")}
    r = train(cfg, *RUN, "--batch-size", 2 * B, "--name", "single")
    assert r.returncode == 2 and "already holds a run" in r.stderr, r.stdout + r.stderr
    assert "--name single --resume auto" in r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in folder.rglob("*")} == before


def test_readers_take_a_sharded_checkpoint_as_a_file(root, cfg, full, tmp_path):
    """infer, export, status and report on the two-rank run: weights consolidated in the reading
    process, sizes of the folders' files."""
    folder = root / "checkpoints" / "full"
    r = ok(run_stage("infer", "--config", cfg, "--checkpoint", folder, "--prompt", "The history of",
                     "--max-new-tokens", 3))
    assert "using checkpoint_best.dcp" in r.stdout + r.stderr
    ok(run_stage("export", "--config", cfg, "--checkpoint", folder / "checkpoint_latest.dcp",
                 "--format", "hf", "--out", tmp_path / "hf"))
    from safetensors.torch import load_file
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    mine = ckpt(root, "full", "checkpoint_latest.dcp")["model"]
    assert torch.equal(exported["model.embed_tokens.weight"], mine["tok_embeddings.weight"])
    assert torch.equal(exported["model.layers.1.mlp.down_proj.weight"], mine["layers.1.mlp.w_down.weight"])
    st = ok(run_stage("status", "full", "--config", cfg)).stdout
    assert "checkpoint_latest.dcp" in st and " 0.0 MB" not in st
    ok(run_stage("report", "full", "--config", cfg))
    md = (root / "reports" / "full" / "report.md").read_text()
    assert re.search(r"\| `checkpoint_latest\.dcp` \| [1-9][\d.]* MB \|", md), md
    assert "| parameters | 2,171,200" in md               # model_args from the sharded checkpoint


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP2 over NCCL needs two GPUs")
@pytest.mark.parametrize("offload", [False, True], ids=["on_gpu", "cpu_offload"])
def test_two_gpus_train_in_bf16_with_fp32_master_weights(root, cfg, single, offload):
    """NCCL, bf16 MixedPrecisionPolicy (and CPU offload): the sharded master weights stay fp32
    and step 1's loss (the same initial weights and windows as ``single``) agrees with the fp32
    one-process run to bf16 rounding."""
    name = f"gpu_{offload}"
    ok(run_stage(*two_ranks(cfg, "--name", name, "--device", "cuda", "--dtype", "bf16"),
                 *(["--cpu-offload"] if offload else [])))
    c = ckpt(root, name, "checkpoint_latest.dcp")
    assert c["step"] == STEPS and all(v.dtype == torch.float32 for v in c["model"].values())
    lg, ls = losses(log_of(root, name)), losses(log_of(root, "single"))
    assert abs(lg[1] - ls[1]) <= 2e-2 * ls[1], (lg, ls)
    assert lg[STEPS] < lg[1]


@pytest.mark.cuda
def test_one_gpu_with_cpu_offload_shards_over_a_group_of_one(root, cfg, single):
    """FSDP2's CPU offload on one GPU (a model whose training state outgrows the GPU): the
    process gets a group of one (utils/training/distributed.py ``init_single``), the model is
    sharded over it with its state in CPU memory, and step 1's loss agrees with the one-process
    fp32 run to bf16 rounding."""
    p = ok(train(cfg, *RUN, "--batch-size", 2 * B, "--name", "offload1", "--device", "cuda", "--dtype", "bf16",
                 "--cpu-offload"))
    assert "sharded over 1 processes, weights and optimizer state in CPU memory" in p.stdout, p.stdout
    lg, ls = losses(log_of(root, "offload1")), losses(log_of(root, "single"))
    assert abs(lg[1] - ls[1]) <= 2e-2 * ls[1], (lg, ls)
