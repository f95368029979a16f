"""A public instruct model through the whole pipeline, as a user runs it: fine-tune
SmolLM2-135M-Instruct (a Hugging Face folder) on the offline SFT samples with its own chat
template, export the result as a Hugging Face folder and as GGUF, then ask the GGUF one chat
question in llama.cpp and the Hugging Face folder the same question in transformers.

    python examples/finetune_public_model.py [--model data/samples/smollm2/SmolLM2-135M-Instruct]
        [--workdir runs/public-model] [--steps 4] [--max-length 256]
        [--question "What is the capital of France?"]

Every stage runs as `python main.py ...` under a config in --workdir (tokenizer.name = the
model folder, so `sft prepare` takes its tokenizer and chat template). The question is framed
by each consumer from the export's own files: transformers with the folder's chat template,
llama.cpp with the template stored in the GGUF (llama-cpp-python's Jinja chat formatter, as its
chat completion does). It prints both answers and one JSON line (``result: {...}``) and exits 1
when the prompt or the greedy answer's ids differ. Nothing of this project is imported.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stage(*args: str) -> None:
    cmd = [sys.executable, str(ROOT / "main.py"), *args]
    print("$ python main.py " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def fine_tune(a) -> Path:
    """sft prepare + sft train; returns the SFT run folder."""
    a.workdir.mkdir(parents=True, exist_ok=True)
    cfg = a.workdir / "config.json"
    cfg.write_text(json.dumps({"paths": {"root": str(a.workdir.resolve()), "samples_dir": str(ROOT / "data" / "samples")},
                               "tokenizer": {"name": str(a.model.resolve())},
                               "sft": {"max_length": a.max_length, "val_split": 0.0}}, indent=2))
    stage("sft", "prepare", "--config", str(cfg), "--dataset", "samples", "--limit", str(a.records))
    stage("sft", "train", "--config", str(cfg), "--init-from-hf", str(a.model), "--max-steps", str(a.steps),
          "--batch-size", "2", "--sample-tokens", "0", "--name", "public")
    return sorted((a.workdir / "checkpoints").glob("sft_public_*"))[-1]


def export(a, run: Path) -> tuple[Path, Path]:
    cfg = str(a.workdir / "config.json")
    hf, gguf = a.workdir / "exports" / "hf", a.workdir / "exports" / "gguf"
    stage("export", "--config", cfg, "--checkpoint", str(run), "--format", "hf", "--out", str(hf), "--force")
    stage("export", "--config", cfg, "--checkpoint", str(run), "--format", "gguf", "--out", str(gguf), "--force")
    return hf, next(gguf.glob("*.gguf"))


def ask_transformers(hf: Path, question: str, n: int) -> tuple[list[int], list[int], str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                     return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n)
    new = out[0, len(prompt):].tolist()
    stops = model.generation_config.eos_token_id
    stops = [stops] if isinstance(stops, int) else list(stops or [])
    new = new[:next((i for i, t in enumerate(new) if t in stops), len(new))]
    return prompt, new, tok.decode(new, skip_special_tokens=True)


def ask_llama_cpp(gguf: Path, question: str, n: int) -> tuple[list[int], list[int], str]:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    llm = Llama(model_path=str(gguf), n_ctx=512, logits_all=True, verbose=False, seed=0)
    try:
        meta = llm.metadata
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        token = lambda key: llm.detokenize([int(meta[key])], special=True).decode() if key in meta else ""  # noqa: E731
        fmt = Jinja2ChatFormatter(meta["tokenizer.chat_template"], eos_token=token("tokenizer.ggml.eos_token_id"),
                                  bos_token=token("tokenizer.ggml.bos_token_id"))
        text = fmt(messages=[{"role": "user", "content": question}]).prompt
        prompt = llm.tokenize(text.encode(), add_bos=False, special=True)
        llm.eval(prompt)
        new: list[int] = []
        while len(new) < n:
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            if llama_cpp.llama_vocab_is_eog(vocab, nxt):    # its end-of-generation tokens
                break
            new.append(nxt)
            llm.eval([nxt])
        return prompt, new, llm.detokenize(new).decode("utf-8", errors="replace")
    finally:
        llm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "data" / "samples" / "smollm2" / "SmolLM2-135M-Instruct",
                    help="a Hugging Face Llama folder with a chat template (default: SmolLM2-135M-Instruct "
                         "from `python main.py samples`)")
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "public-model")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps of the fine-tune")
    ap.add_argument("--records", type=int, default=64, help="SFT records prepared")
    ap.add_argument("--max-length", type=int, default=256,
                    help="tokens of the longest SFT example kept (sft.max_length; longer ones are left out)")
    ap.add_argument("--question", default="What is the capital of France?")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    a = ap.parse_args()
    run = fine_tune(a)
    hf, gguf = export(a, run)
    hf_prompt, hf_new, hf_text = ask_transformers(hf, a.question, a.max_new_tokens)
    cpp_prompt, cpp_new, cpp_text = ask_llama_cpp(gguf, a.question, a.max_new_tokens)
    print(f"transformers ({hf.name}): {hf_text!r}\nllama.cpp ({gguf.name}): {cpp_text!r}")
    same = hf_prompt == cpp_prompt and hf_new == cpp_new
    print("result: " + json.dumps({"run": str(run), "hf": str(hf), "gguf": str(gguf), "prompt_ids_equal":
                                   hf_prompt == cpp_prompt, "answer_ids_equal": hf_new == cpp_new,
                                   "answer_tokens": len(hf_new), "transformers": hf_text, "llama_cpp": cpp_text}))
    if not same:
        print("the ids differ: the export does not reproduce the model in llama.cpp", file=sys.stderr)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
