"""Stage ``rl``: on-policy RL on verifiable rewards (GRPO) from an SFT run or an imported model.

    python main.py rl --checkpoint checkpoints/sft_lima_<time>/checkpoint_best.pt
    python main.py rl --init-from-hf data/samples/smollm2/SmolLM2-135M-Instruct [--task arithmetic]
    python main.py rl --checkpoint PATH --task my_task.jsonl [--steps 100] [--kl-beta 0.04]
    python main.py rl --resume checkpoints/rl_<name>_<time>/checkpoint_latest.pt   (or auto)

Each step takes ``rl.prompts_per_step`` training prompts of the task, samples
``rl.group_size`` replies to each with the current weights (the engine's continuous batching,
all of them in one batch), scores them with the task's verifier, and takes one optimizer step
on the policy-gradient loss with group-relative advantages (utils/rl/grpo.py; the task and its
verifier: utils/rl/tasks.py; every number in the ``rl`` config section). Prompts are rendered
with the model's own chat template (an SFT run's or an imported model's), so the model answers
in the format it was taught. Each validation (``rl.eval_every`` steps, and step 0: the model as
it started) measures pass@1 on the held-out prompts (greedy) and prints one held-out reply.

The run is a run folder like every training stage's (utils/stage.py): checkpoints_dir/
rl_<name>_<time>/ with checkpoint_latest.pt (no "best": there is no validation loss) and
rl_config.json (its base, task and settings), logs/raw_metrics/<run>.jsonl (``reward`` per
logged step, ``val_pass_at_1`` per validation), TensorBoard, ``status`` and ``report``.
Ctrl-C or SIGTERM saves and prints the resume command (exit 130); the resumed run samples the
same replies and gets the same rewards as an uninterrupted one. Details: docs/rl.md.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Optional, Sequence

from utils.atomic import write_json_atomic
from utils.cli import PipelineError, StageParser, cli_lora_flags, run_stage
from utils.data import chat, sft
from utils.data.chat import Rules
from utils.data.tok import require_bos_eos
from utils.generation.detok import TextDecoder
from utils.rl.tasks import Task, load_task
from utils import post_start
from utils.post_start import Source
from utils.run import load_checkpoint, resume_command_post, stage_config_file

RL_CONFIG_FILE = stage_config_file("rl")


def build_parser() -> StageParser:
    p = StageParser("main.py rl", "On-policy RL on verifiable rewards (GRPO): sample groups of replies, "
                    "score them with the task's verifier, reinforce the better ones (resumable).",
                    test="quick mode: at most rl.test_steps steps")
    post_start.start_flags(p, "rl", "an RL run", "the checkpoint to start from (an SFT run's, usually)",
                           "start from a local Hugging Face Llama model (folder or .gguf file) instead",
                           "task")
    p.config_flag("--task", key="rl.task", metavar="NAME|FILE",
                  help="arithmetic (synthetic), or a JSONL file of {prompt, answer} lines")
    p.config_flag("--checker", key="rl.checker", choices=["auto", "exact", "numeric"],
                  help="the verifier (auto: the task's own)")
    p.config_flag("--steps", key="rl.steps", type=int, metavar="N", help="optimizer steps")
    p.config_flag("--group-size", key="rl.group_size", type=int, metavar="G", help="replies per prompt")
    p.config_flag("--prompts-per-step", key="rl.prompts_per_step", type=int, metavar="N",
                  help="prompts per step")
    p.config_flag("--max-new-tokens", key="rl.max_new_tokens", type=int, metavar="N",
                  help="tokens per reply at most")
    p.config_flag("--temperature", key="rl.temperature", type=float, metavar="T",
                  help="rollout sampling temperature")
    p.config_flag("--lr", key="rl.lr", type=float, metavar="LR", help="learning rate")
    p.config_flag("--kl-beta", key="rl.kl_beta", type=float, metavar="B",
                  help="KL penalty weight to the starting model (0: none)")
    p.config_flag("--advantage", key="rl.advantage", choices=["grpo", "mean"],
                  help="per-group advantage: grpo (mean and std) or mean (mean only)")
    p.config_flag("--val-prompts", key="rl.val_prompts", type=int, metavar="N", help="held-out prompts")
    p.config_flag("--eval-every", key="rl.eval_every", type=int, metavar="N",
                  help="steps between pass@1 validations")
    p.config_flag("--device", key="training.device", metavar="DEV", help="auto, cpu, cuda or cuda:N")
    p.config_flag("--dtype", key="rl.dtype", choices=["auto", "bf16", "fp16", "fp32"],
                  help="autocast precision of the rollouts and the training steps alike")
    p.config_flag("--keep-dropout", key="rl.keep_dropout", action="store_const", const=True,
                  help="keep dropout in the policy (default: off, so the policy trained is the one that sampled)")
    p.config_flag("--seed", key="training.seed", type=int, metavar="N",
                  help="random seed (task split, prompt order, rollouts)")
    p.config_flag("--log-every", key="logging.log_every", type=int, metavar="N", help="steps between log records")
    cli_lora_flags(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, cfg = parse(argv)
    return set_up(cfg, args, argv).finish()


def parse(argv: Sequence[str]):
    args, cfg = build_parser().parse(argv)
    post_start.check_start_flags(args, "rl", "a checkpoint to start from, e.g. an SFT run's", "an RL run")
    post_start.check_lora_flags(args, cfg)
    return args, cfg


def set_up(cfg, args, argv: Sequence[str]):
    """The steps of a start (utils/stage.py runs the rest); what they hold is freed on return."""
    from utils import stage     # torch-bound (the model, the trainer): --help does not wait for it
    src = post_start.open_source(cfg, args, "rl")
    tok, tok_info = post_start.open_tokenizer(cfg, src)
    rules = run_rules(stage.kept_rules(tok, src.imported, src.ckpt), src, tok)
    task = load_task(cfg.rl, cfg.training.seed, cfg.resolve)
    check_fits(task, tok, rules, cfg.rl, src.model_args)
    start = post_start.start_of(cfg, src, "rl", args.lora, rules)
    parts = stage.Parts(
        lr_key="rl.lr", tokenizer=tok,
        spec=functools.partial(rl_spec, cfg, src, task, tok, tok_info, rules),
        run_files=functools.partial(run_files, cfg, args, src, task),
        resume_command=resume_command_post("rl", argv, src.run_dir / "checkpoint_latest.pt"),
        closing=functools.partial(closing_line, src.run_dir, start.lora is not None))
    return post_start.run_start(cfg, start, parts)


# --------------------------------------------------------------------------- the start
def run_rules(kept: Optional[Rules], src: Source, tok) -> Rules:
    """The base's rules with its chat template: an SFT run's or an imported model's own; a
    model without one (pre-trained only) is prompted in our User/Assistant template."""
    base = kept or Rules.ours(tok, src.ckpt.get("chat_template"))
    template = base.template or src.ckpt.get("chat_template")
    if template is None:
        require_bos_eos(tok, "the run's tokenizer")
        template = sft.default_template()
        print("rl: the base has no chat template (not fine-tuned?); prompts use ours (User/Assistant).",
              flush=True)
    return post_start.run_rules(base, src, tok, template)


def prompt_ids(tok, rules: Rules, items) -> list[list[int]]:
    return [chat.chat_prompt_ids(tok, rules.template, "", [], it.prompt) for it in items]


def check_fits(task: Task, tok, rules: Rules, rl_cfg, model_args) -> None:
    """Refuse a task whose longest prompt plus a reply does not fit the model's context."""
    longest = max(len(p) for p in prompt_ids(tok, rules, task.train + task.val))
    if longest + rl_cfg.max_new_tokens > model_args.max_seq_len:
        raise PipelineError(f"the task's longest prompt ({longest} tokens) plus rl.max_new_tokens "
                            f"({rl_cfg.max_new_tokens}) exceeds the model's context of "
                            f"{model_args.max_seq_len} tokens; lower rl.max_new_tokens or shorten the prompts.")


# --------------------------------------------------------------------------- the spec
def end_token(tok, rules: Rules) -> int:
    """The padding id of a tokenizer without one: the template's end of turn, else EOS."""
    turn_end = (rules.template or {}).get("end_of_turn")
    if turn_end is not None:
        return int(tok.convert_tokens_to_ids(turn_end))
    if tok.eos_token_id is None:
        raise PipelineError("the run's tokenizer has no EOS token: a reply's end cannot be trained on.")
    return int(tok.eos_token_id)


def reply_decoder(tok, rules: Rules):
    """new ids -> the reply's text, as infer decodes an answer in this template."""
    continues, lead = chat.answer_decoding(rules.template)

    def decode(prompt: list[int], ids: list[int]) -> str:
        d = TextDecoder(tok, prompt[-1:] if continues else (), lead=lead)
        for t in ids:
            d.push(t)
        return d.text()
    return decode


def scorer(task: Task, items, prompts, decode):
    return lambda i, ids: task.reward(decode(prompts[i], ids), items[i])


def reference_model(src: Source, model, kl_beta: float):
    """(the frozen starting model for the KL penalty, the sha256 of its weights); (None, None)
    when kl_beta is 0. On resume the base's weights are read again (the run's model holds the
    resumed ones by then) and must hash as the run recorded at its start: a base rewritten in
    between would change the KL term silently (as dpo checks its stored reference)."""
    if kl_beta <= 0:
        return None, None
    if src.resumed:
        if src.base_imported:
            from utils.hf.import_hf import load_hf_llama    # torch and transformers: only for an import
            weights = load_hf_llama(src.base).model.state_dict()
        else:
            weights = load_checkpoint(src.base, purpose="weights")["model"]
    else:
        weights = src.ckpt["model"]
    from utils.rl.grpo import weights_sha256      # torch-bound
    digest = weights_sha256(weights)
    recorded = (src.ckpt.get("rl") or {}).get("reference_sha256") if src.resumed else None
    if recorded is not None and recorded != digest:
        raise PipelineError(f"--resume {src.path}: the KL reference, the run's base {src.base}, has "
                            f"changed since the run started (sha256 {digest[:12]}, recorded {recorded[:12]}): "
                            "its KL term would differ from the one the run trained with. Put the base back "
                            "as it was, or start a new run from it (--checkpoint).")
    from model import create_model      # torch-bound
    ref = create_model(src.model_args)   # the plain network: a LoRA run's model carries its adapter
    ref.load_state_dict(weights, strict=True)
    return ref.to(model.device).eval().requires_grad_(False), digest


def rl_spec(cfg, src: Source, task: Task, tok, tok_info, rules: Rules, model):
    """RL as a TrainSpec: rollouts as the data, the policy-gradient loss, pass@1 as val_fn."""
    from utils import stage     # torch-bound
    import torch
    from utils.rl import grpo
    from utils.training.trainer import TrainSpec, resolve_dtype
    r = cfg.rl
    decode = reply_decoder(tok, rules)
    train_p, val_p = prompt_ids(tok, rules, task.train), prompt_ids(tok, rules, task.val)
    pad = tok.pad_token_id if tok.pad_token_id is not None else end_token(tok, rules)
    settings = grpo.RolloutSettings(r.group_size, r.prompts_per_step, r.max_new_tokens, r.temperature,
                                    r.top_k, rules.stop_ids, pad, r.advantage == "grpo")
    stage.say_dropout("rl", model, r.keep_dropout)
    amp = resolve_dtype(r.dtype, model.device)          # rollouts at the training steps' precision
    data = grpo.Rollouts(model, train_p, settings, scorer(task, task.train, train_p, decode), cfg.training.seed,
                         amp=None if amp == torch.float32 else amp)
    val_score = scorer(task, task.val, val_p, decode)
    engine = data.engine
    ref, ref_sha256 = reference_model(src, model, r.kl_beta)
    stage.say_adapter("rl", model)
    print(f"rl: task {task.name} ({task.source}; checker {task.checker}): {len(task.train)} training / "
          f"{len(task.val)} held-out prompts; {total_steps(cfg)} steps of {r.prompts_per_step} prompts x "
          f"{r.group_size} replies; lr {r.lr:g}; kl_beta {r.kl_beta:g}; advantage {r.advantage}; on "
          f"{model.device}; base {src.base}.", flush=True)
    record = stage.run_record("rl", cfg, tok_info, rules, {"rl": {"base_checkpoint": str(src.base),
                                                                  "task": task.describe(),
                                                                  "reference_sha256": ref_sha256}})

    def sample(m) -> list[tuple[str, str]]:
        (ids, _), = grpo.generate_replies(engine, val_p[:1], 1, r.max_new_tokens, 0.0, 0, rules.stop_ids, 0)
        return [(task.val[0].prompt, decode(val_p[0], ids))]

    return TrainSpec(model, src.model_args, data, None, optimizer=optimizer_spec(r),
                     settings=train_settings(cfg, len(data)), record=record,
                     loss=functools.partial(grpo.pg_loss, kl_beta=r.kl_beta, ref_model=ref),
                     val_fn=lambda m: {"pass_at_1": grpo.pass_at_1(engine, val_p, val_score,
                                                                   r.max_new_tokens, rules.stop_ids)},
                     sample_fn=sample)


def total_steps(cfg) -> int:
    return min(cfg.rl.steps, cfg.rl.test_steps) if cfg.test else cfg.rl.steps


def optimizer_spec(r):
    from utils.training.trainer import OptimizerSpec     # torch-bound
    return OptimizerSpec("adamw", r.lr, r.beta1, r.beta2, r.weight_decay)


def train_settings(cfg, steps_per_epoch: int):
    """The run's numbers from the ``rl`` section (how it is executed: ``training``, ``logging``)."""
    from utils.training.trainer import Settings     # torch-bound
    r, hp, log, total = cfg.rl, cfg.training, cfg.logging, total_steps(cfg)
    return Settings(total_steps=total, min_lr=r.lr * r.min_lr_ratio,
                    warmup_steps=int(total * r.warmup_ratio + 1e-9), warmup_source="rl.warmup_ratio",
                    eval_interval=min(r.eval_every, total), eval_batches=1,
                    checkpoint_every=total, keep_checkpoints=0, steps_per_epoch=steps_per_epoch,
                    grad_accum=1, grad_clip=r.grad_clip, dtype=r.dtype, patience=0,
                    log_every=log.log_every, smoothing_window=log.smoothing_window, compile=hp.compile,
                    activation_checkpointing=hp.activation_checkpointing)


# --------------------------------------------------------------------------- run files, the end
def run_files(cfg, args, src: Source, task: Task, spec) -> dict:
    """rl_config.json (what the run started from, its task and settings); the log's hyperparameters."""
    from utils import stage     # torch-bound
    from utils.training.trainer import resolve_dtype
    st = spec.settings
    hyper = {**dataclasses.asdict(cfg.rl), "total_steps": st.total_steps, "seed": cfg.training.seed,
             "dtype": str(resolve_dtype(st.dtype, spec.model.device)), "device": str(spec.model.device),
             "steps_per_epoch": st.steps_per_epoch, "lora": stage.adapter_record(spec.model)}
    write_json_atomic(src.run_dir / RL_CONFIG_FILE, {
        "run": src.run_dir.name, "base_checkpoint": str(src.base),
        "base": src.base_record(),
        "resumed_from": str(args.resume) if src.resumed else None, "task": task.describe(),
        "chat_template": spec.record.chat_template, "hyperparameters": hyper,
        "model": src.model_args.to_dict(), "tokenizer": spec.record.tokenizer, "config": cfg.to_dict()})
    return {"run": src.run_dir.name, **hyper}


def closing_line(run_dir: Path, adapter: bool, result, logger) -> str:
    """Where the model is and how to try it; a LoRA run also writes its adapter as a PEFT folder."""
    latest = run_dir / "checkpoint_latest.pt"
    line = (f"rl: {result.reason} at step {result.step}; checkpoints in {run_dir}. Report: python main.py "
            f"report {run_dir.name}; try it: python main.py infer --checkpoint {latest}")
    return post_start.closing("rl", run_dir, adapter, line, latest)


if __name__ == "__main__":
    run_stage(main)
