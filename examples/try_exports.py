"""Run one prompt through an exported model the way a user of the export would: the Hugging
Face folder with transformers, the GGUF file with llama.cpp (llama-cpp-python). Nothing of this
project is imported.

    python examples/try_exports.py --hf exports/demo-hf --gguf exports/demo-gguf/demo-f16.gguf \\
        --prompt "Why is the sky blue?" [--chat]
"""
from __future__ import annotations

import argparse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", help="an exported Hugging Face model folder")
    ap.add_argument("--gguf", help="an exported .gguf file")
    ap.add_argument("--prompt", default="The history of")
    ap.add_argument("--chat", action="store_true", help="render the prompt with the chat template")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    a = ap.parse_args()
    if a.hf:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(a.hf, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(a.hf, local_files_only=True)
        if a.chat:      # the export's chat template: exactly the ids the model was trained on
            ids = tok.apply_chat_template([{"role": "user", "content": a.prompt}],
                                          add_generation_prompt=True, return_tensors="pt")
        else:           # BOS + the text, as the model saw documents
            ids = tok(a.prompt, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=a.max_new_tokens, do_sample=False)
        print(f"transformers ({a.hf}): {tok.decode(out[0, ids['input_ids'].shape[1]:], skip_special_tokens=True)!r}")
    if a.gguf:
        from llama_cpp import Llama
        llm = Llama(model_path=a.gguf, n_ctx=0, verbose=False)   # n_ctx 0: the model's own context
        try:
            if a.chat:
                out = llm.create_chat_completion([{"role": "user", "content": a.prompt}],
                                                 max_tokens=a.max_new_tokens, temperature=0)
                text = out["choices"][0]["message"]["content"]
            else:
                text = llm(a.prompt, max_tokens=a.max_new_tokens, temperature=0)["choices"][0]["text"]
        finally:
            llm.close()
        print(f"llama.cpp ({a.gguf}): {text!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
