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
	@echo "== tokenizer: the Llama-style SentencePiece sample (stands in for CodeLlama offline)"
	$(PY) main.py tokenize $(OFFLINE)
	$(PY) main.py tokenize $(OFFLINE) --encode "Wikipedia is a free online encyclopedia. 日本語 😀"
	$(PY) main.py tokenize $(OFFLINE) --decode "1,14735,28723,349,264,1933,3270,28705,2"
	@echo "== tokenizer: train a small BPE on real news text"
	$(PY) main.py tokenize $(OFFLINE) --train --input data/samples/news/lee_background.cor --vocab-size 2000

test: samples
	$(PY) -m pytest -q
