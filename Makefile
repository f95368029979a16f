# Two commands do all the set-up on a fresh machine (Python 3.11, pip, make):
#   make demo   venv + pinned requirements + offline samples, then every built stage end to end
#   make test   same set-up, then the test suite (what .ci/run calls)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OFFLINE := --config configs/offline.json
# Everything here runs without the Hugging Face hub.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: venv samples demo test perf

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt
	touch $@

venv: $(VENV)/.installed

samples: venv
	$(PY) main.py samples

demo: samples
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
	@echo "== demo done: outputs in data/, tokenizers/ (all git-ignored)"

test: samples
	$(PY) -m pytest -q
